"""Which eligible replica a request goes to: the ``Router`` seam and its algorithms.

``MostFreeRouter`` (the most free slots), ``LeastLoadRouter`` (measured load) and
``SpreadStrictRouter`` (least load, spreading the strict classes' streams); the routers that
also weigh where a request is cheapest (``session-affinity``, ``cache-aware``) are in
``core.affinity``. ``ROUTERS`` builds each by its config name (``fleet.router``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from qosgate.config import CacheRouting

if TYPE_CHECKING:
    from qosgate.core.replica import Replica
    from qosgate.core.request import Request


class Router(Protocol):
    name: str
    # whether it reads ``Request.prefix``: the gateway hashes a prompt's blocks only for one
    reads_prefix: bool

    def pick(self, req: Request, candidates: Sequence[Replica], now: float) -> Replica | None:
        """One of ``candidates`` (each eligible, serving the request's model, with room) or None
        to leave the request queued."""
        ...

    # what a router that keeps state of its own is told (``RouterHooks``: nothing for the
    # others). ``Fleet`` calls these as it keeps each replica's books.
    def placed(self, req: Request, rep: Replica, now: float) -> int:
        """``req`` was sent to ``rep`` (not a paused request resuming there): the prompt tokens
        it expects ``rep``'s prefix cache to hold (what fairness does not charge)."""
        ...

    def started(self, req: Request, rep: Replica) -> None:
        """``req``'s first byte came from ``rep``: its prefill is done."""
        ...

    def left(self, req: Request, rep: Replica) -> None:
        """``req`` left ``rep`` (ended, pulled back, failed)."""
        ...

    def follow_events(self, name: str) -> None:
        """Replica ``name``'s engine publishes its KV events: its index follows them only."""
        ...

    def cache_lost(self, name: str, now: float) -> None:
        """Replica ``name``'s cache is gone: it went down, died or restarted."""
        ...

    def observe_cache(self, name: str, now: float, stored: Sequence[int],
                      removed: Sequence[int], cleared: bool) -> None:
        """Replica ``name``'s engine stored or evicted blocks (keys as ``wire.prefix.chain``)."""
        ...

    def holds(self, req: Request, now: float) -> bool:
        """``req`` is left queued by choice: it waits, within its bound, for a warm replica
        or for KV room on one."""
        ...

    def wake_at(self, now: float) -> float:
        """When a request this router holds must be placed anyway (inf: none held)."""
        ...


class RouterContext(NamedTuple):
    """What a router is built from: the strict classes' TPOT and TTFT budgets (class level ->
    seconds), the class levels that may wait for a warm replica, and ``fleet.cache``."""

    strict_tpot_s: Mapping[int, float] = {}
    strict_ttft_s: Mapping[int, float] = {}
    may_wait_levels: frozenset[int] = frozenset()
    cache: CacheRouting = CacheRouting()


class RouterHooks:
    """The ``Router`` hooks of a router that keeps no state: each does nothing."""

    reads_prefix = False

    def placed(self, req: Request, rep: Replica, now: float) -> int:
        return 0

    def started(self, req: Request, rep: Replica) -> None:
        return None

    def left(self, req: Request, rep: Replica) -> None:
        return None

    def follow_events(self, name: str) -> None:
        return None

    def cache_lost(self, name: str, now: float) -> None:
        return None

    def observe_cache(self, name: str, now: float, stored: Sequence[int],
                      removed: Sequence[int], cleared: bool) -> None:
        return None

    def holds(self, req: Request, now: float) -> bool:
        return False

    def wake_at(self, now: float) -> float:
        return _INF


_INF = float("inf")


class MostFreeRouter(RouterHooks):
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


class LeastLoadRouter(RouterHooks):
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
        best_key = (True, _INF)
        for rep in candidates:
            key = self.load(req, rep, now)
            if key is not None and key < best_key:
                best, best_key = rep, key
        return best

    def load(self, req: Request, rep: Replica, now: float) -> tuple[bool, float] | None:
        """``rep``'s (saturated, load score) with ``req`` on it; None: its window is full."""
        window = rep.window
        n = len(rep.inflight)
        if n >= window:
            return None
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
        return (saturated, score)

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
        slow = misses_tpot(rep, budget)
        return rep.strict_streams / max(1, window) + (1.0 if slow else 0.0)


def misses_tpot(rep: Replica, budget_s: float) -> bool:
    """``rep``'s engine's recent time per token is past ``budget_s``: a stream there misses it."""
    return rep.itl_s is not None and rep.itl_s > budget_s


def _session_affinity(ctx: RouterContext) -> Router:
    from qosgate.core.affinity import SessionAffinityRouter  # (it builds on the classes here)

    return SessionAffinityRouter(ctx)


def _cache_aware(ctx: RouterContext) -> Router:
    from qosgate.core.affinity import CacheAwareRouter

    return CacheAwareRouter(ctx)


# each router by name, built from a ``RouterContext`` (the strict classes' budgets and
# ``fleet.cache``), which only some of them read
ROUTERS: dict[str, Callable[[RouterContext], Router]] = {
    "most-free": lambda _: MostFreeRouter(),
    "least-load": lambda _: LeastLoadRouter(),
    SpreadStrictRouter.name: lambda ctx: SpreadStrictRouter(ctx.strict_tpot_s),
    "session-affinity": _session_affinity,
    "cache-aware": _cache_aware,
}


def build_router(name: str, ctx: RouterContext | None = None) -> Router:
    """The router called ``name``."""
    try:
        make = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r} (known: {', '.join(ROUTERS)})") from None
    return make(ctx if ctx is not None else RouterContext())
