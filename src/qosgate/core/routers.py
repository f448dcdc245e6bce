"""Which eligible replica a request goes to: the ``Router`` seam and its algorithms.

``MostFreeRouter`` (the most free slots), ``LeastLoadRouter`` (measured load) and
``SpreadStrictRouter`` (least load, spreading the strict classes' streams); ``ROUTERS`` builds each
by its config name (``fleet.router``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from qosgate.core.replica import Replica
    from qosgate.core.request import Request


class Router(Protocol):
    name: str

    def pick(self, req: Request, candidates: Sequence[Replica], now: float) -> Replica | None:
        """One of ``candidates`` (each eligible, serving the request's model, with room) or None
        to leave the request queued."""
        ...


class MostFreeRouter:
    """The replica with the most free slots (first listed on ties)."""

    name = "most-free"

    def pick(self, req: Request, candidates: Sequence[Replica], now: float) -> Replica | None:
        best: Replica | None = None
        best_free = 0
        for rep in candidates:
            f = rep.window - len(rep.inflight)
            if f > best_free:
                best, best_free = rep, f
        return best


class LeastLoadRouter:
    """The least loaded replica by measured load: its share of the window in flight (with the
    request to place), prompt tokens it has not answered yet (local accounting, exact and
    immediate) and what its last scrape said of its own queue and KV cache. Data older than
    ``stale_s`` counts as saturated; a saturated replica (its queue past ``waiting_saturated``
    per window slot, or its KV cache past ``kv_saturated``) is taken only if every candidate
    is. (Weighing replicas by their recent dispatch-to-first-byte time was tried and reverted:
    the average lags a growing queue and herded traffic onto one replica, docs/guides/fleet.md.)"""

    name = "least-load"

    def __init__(
        self,
        stale_s: float = 5.0,
        kv_saturated: float = 0.97,
        waiting_saturated: float = 0.25,
        tokens_per_slot: float = 2048.0,
    ) -> None:
        self.stale_s = stale_s
        self.kv_saturated = kv_saturated
        self.waiting_saturated = waiting_saturated
        self.tokens_per_slot = tokens_per_slot

    def pick(self, req: Request, candidates: Sequence[Replica], now: float) -> Replica | None:
        best: Replica | None = None
        best_key = (True, float("inf"))
        for rep in candidates:
            window = rep.window
            n = len(rep.inflight)
            if n >= window:
                continue
            score = (n + 1 + rep.prefill_tokens / self.tokens_per_slot) / max(1, window)
            score += self._extra(req, rep, window)
            sig = rep.signals
            saturated = False  # no scrape at all (an engine without metrics): no evidence
            if sig is not None:
                if now - sig.at > self.stale_s:
                    saturated = True
                else:
                    if sig.waiting:
                        score += sig.waiting / max(1, window)
                        saturated = sig.waiting > self.waiting_saturated * window
                    if sig.kv_usage is not None and sig.kv_usage >= self.kv_saturated:
                        saturated = True
            key = (saturated, score)
            if key < best_key:
                best, best_key = rep, key
        return best

    def _extra(self, req: Request, rep: Replica, window: int) -> float:
        """What a variant adds to a replica's load score for this request (nothing here)."""
        return 0.0


class SpreadStrictRouter(LeastLoadRouter):
    """``least-load``, and for a request of a strict class two more terms: the strict streams
    the replica already runs (counted twice, so realtime spreads over the fleet), and a full
    window's worth on a replica whose engine's time per token is past the request's TPOT
    budget (it would miss there). Why: with the prefill budget, a replica streaming to realtime
    keeps the other classes' prompts off and so looks least loaded to the next realtime request;
    realtime piles onto one replica by itself, and that replica's death cuts all its streams
    (docs/experiments/simulator-fleet.md, ``fleet-faults``)."""

    name = "least-load-spread"

    def __init__(self, strict_tpot_s: Mapping[int, float] | None = None) -> None:
        super().__init__()
        self.strict_tpot_s = dict(strict_tpot_s or {})  # class level -> its TPOT budget

    def _extra(self, req: Request, rep: Replica, window: int) -> float:
        budget = self.strict_tpot_s.get(req.class_level)
        if budget is None:
            return 0.0
        slow = rep.itl_s is not None and rep.itl_s > budget
        return rep.strict_streams / max(1, window) + (1.0 if slow else 0.0)


# each router by name, built from the strict classes' TPOT budgets (class level -> seconds),
# which only the one that places strict requests by them reads
ROUTERS: dict[str, Callable[[Mapping[int, float]], Router]] = {
    "most-free": lambda _: MostFreeRouter(),
    "least-load": lambda _: LeastLoadRouter(),
    SpreadStrictRouter.name: SpreadStrictRouter,
}


def build_router(name: str, strict_tpot_s: Mapping[int, float] | None = None) -> Router:
    """The router called ``name``."""
    try:
        make = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r} (known: {', '.join(ROUTERS)})") from None
    return make(strict_tpot_s or {})
