"""Replicas as the core sees them: the models each serves, its window, its breaker, its load.

Each varying piece is a small policy object behind one interface, with the clock passed in, so the
gateway and the simulator run the same ones and a new algorithm is one more small class:

- ``Limit``: the replica's window (requests in flight at most), in the shape of Netflix's
  concurrency-limits (``on_sample``); ``FixedLimit`` is the default.
- ``Breaker``: whether the replica may take new work now. ``AlwaysClosed`` is the default;
  ``OutlierDetector`` ejects a replica after consecutive failures before the first byte, for a time
  that grows with each ejection (Envoy's outlier detection, with its defaults).
- ``Router``: which eligible replica a request goes to; ``MostFreeRouter`` is the default.

A ``Replica`` also knows whether its health probe says it is up, until when an upstream's
back-pressure (429/503 with Retry-After) cools it, and the last ``LoadSignals`` it reported.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from qosgate.core.signals import LoadSignals

if TYPE_CHECKING:
    from qosgate.core.request import Request
    from qosgate.core.tpot_guard import TpotGuard


# ---------------------------------------------------------------------- Limit
class Limit(Protocol):
    """A replica's window. ``limit`` is read on every dispatch; ``on_sample`` is told how one
    request went (``latency`` seconds to its first token, the in-flight count when it was sent,
    ``dropped`` if the engine refused it with back-pressure)."""

    @property
    def limit(self) -> int: ...

    def on_sample(self, now: float, latency: float, inflight: int, dropped: bool) -> None: ...

    def on_signals(self, now: float, signals: LoadSignals, inflight: int) -> None:
        """What the engine said of its own load (a scrape, or an in-process engine's state)."""
        ...


class FixedLimit:
    """A window that only changes when told to (``set``): today's behaviour."""

    __slots__ = ("limit",)

    def __init__(self, limit: int) -> None:
        self.limit = max(0, limit)

    def set(self, limit: int) -> None:
        self.limit = max(0, limit)

    def on_sample(self, now: float, latency: float, inflight: int, dropped: bool) -> None:
        return None

    def on_signals(self, now: float, signals: LoadSignals, inflight: int) -> None:
        return None


# ---------------------------------------------------------------------- Breaker
class Breaker(Protocol):
    def allow(self, now: float) -> bool:
        """May the replica take new work at ``now``?"""
        ...

    def on_result(self, now: float, ok: bool) -> None:
        """An attempt ended: ``ok`` if it got its first byte, False if it failed before."""
        ...

    def next_change(self) -> float | None:
        """When ``allow`` may change by itself (an ejection ends), or None."""
        ...

    @property
    def ejections(self) -> int: ...

    @property
    def probation(self) -> bool:
        """Back from an ejection and not yet proven: the replica takes one request at a time."""
        ...

    def state(self, now: float) -> str:
        """``closed`` (serving) or ``open`` (ejected)."""
        ...


class AlwaysClosed:
    __slots__ = ()
    ejections = 0
    probation = False

    def allow(self, now: float) -> bool:
        return True

    def on_result(self, now: float, ok: bool) -> None:
        return None

    def next_change(self) -> float | None:
        return None

    def state(self, now: float) -> str:
        return "closed"


class OutlierDetector:
    """Eject after ``consecutive`` failures before the first byte, for ``base_s`` x the number of
    ejections so far, capped at ``max_s``, plus up to ``jitter`` of that at random (seeded), so
    that replicas ejected together do not all come back in the same instant. Envoy's defaults:
    5 consecutive 5xx / gateway failures, 30 s base, 300 s cap. Back from an ejection, a replica
    is on probation (half-open): one request at a time, and one failure ejects it again; its
    first success ends the probation."""

    __slots__ = ("_failures", "_rng", "base_s", "consecutive", "ejected_until", "ejections",
                 "jitter", "max_s", "probation")

    def __init__(
        self,
        consecutive: int = 5,
        base_s: float = 30.0,
        max_s: float = 300.0,
        jitter: float = 0.1,
        seed: int = 0,
    ) -> None:
        self.consecutive = consecutive
        self.base_s = base_s
        self.max_s = max_s
        self.jitter = jitter
        self._rng = random.Random(seed)
        self._failures = 0
        self.ejections = 0
        self.ejected_until = float("-inf")
        self.probation = False

    def allow(self, now: float) -> bool:
        return now >= self.ejected_until

    def on_result(self, now: float, ok: bool) -> None:
        if ok:
            self._failures = 0
            self.probation = False
            return
        if now < self.ejected_until:
            return  # failures of attempts sent before the ejection do not extend it
        self._failures += 1
        if self._failures >= self.consecutive or self.probation:
            self.probation = True
            self._failures = 0
            self.ejections += 1
            span = min(self.max_s, self.base_s * self.ejections)
            self.ejected_until = now + span * (1.0 + self.jitter * self._rng.random())

    def next_change(self) -> float | None:
        return self.ejected_until if self.ejected_until != float("-inf") else None

    def state(self, now: float) -> str:
        return "closed" if now >= self.ejected_until else "open"


# ---------------------------------------------------------------------- Replica
BUDGET_OPEN = 1 << 30  # a replica's prefill budget closed to no class


class Replica:
    """One engine replica: what it serves, how much it may hold, whether it may be used now."""

    __slots__ = ("breaker", "budget_closed_below", "cooled_until", "engine_share", "failing",
                 "guard", "inflight", "itl_s", "itl_seen", "limit", "loan_streams", "loans",
                 "models", "name", "ordered", "other_prefill_tokens", "others_held",
                 "others_inflight", "pausable", "pending", "preemptible", "prefill_tokens",
                 "signals", "strict_streams", "up")

    def __init__(
        self,
        name: str,
        limit: Limit,
        *,
        models: Sequence[str] = (),
        pausable: bool = False,
        breaker: Breaker | None = None,
        up: bool = True,
        guard: TpotGuard | None = None,
        ordered: bool = False,
    ) -> None:
        self.name = name
        self.ordered = ordered  # its engine runs its waiting queue in ``Request.order``
        self.limit = limit
        self.models: frozenset[str] = frozenset(models)  # empty: serves any model
        self.pausable = pausable
        self.breaker: Breaker = breaker if breaker is not None else AlwaysClosed()
        self.inflight: dict[str, Request] = {}
        self.up = up  # the health probe's word; a refused connection also sets it False
        self.cooled_until = float("-inf")  # back-pressure from the engine (429/503 Retry-After)
        self.signals: LoadSignals | None = None
        # the engine's mean inter-token latency between its last two scrapes, the totals it
        # was computed from, and whether that holds the other classes back (the TPOT guard)
        self.itl_s: float | None = None
        self.itl_seen: tuple[float, int] | None = None
        self.others_held = False
        self.guard = guard  # where that hold point sits (None: no TPOT guard)
        # this gateway's share of what the engine holds (1 alone): several gateways feeding
        # one engine each keep that share of the prefill budget
        self.engine_share = 1.0
        # local dispatch-time accounting (the scrape corrects it, the scrape lags it): prompt
        # tokens sent and not yet answered by a first byte, and streams of a strict class
        self.prefill_tokens = 0
        self.other_prefill_tokens = 0  # ... of those, non-strict classes' (the prefill budget)
        self.pending = 0  # requests sent and not answered by a first byte yet
        self.strict_streams = 0
        self.preemptible = 0  # requests in flight that may still be pulled back
        # requests in flight in slots lent from the reserve, and those of them streaming (on
        # an engine that cannot pause, they can no longer give the slot back)
        self.loans = 0
        self.loan_streams = 0
        self.others_inflight = 0  # requests of the non-strict classes in flight
        # the class level of a prompt its prefill budget held in the scheduler's last fill:
        # the classes below it may not use the budget's room (no overtaking by length)
        self.budget_closed_below = BUDGET_OPEN
        # a call failed on it and none has succeeded since: suspect, it gets one unanswered
        # request at a time (a replica that just died must not be sent the whole queue)
        self.failing = False

    @property
    def capacity(self) -> int:
        return self.limit.limit

    @property
    def window(self) -> int:
        """The window in force: the limit's, or one request while on probation."""
        return 1 if self.breaker.probation else self.limit.limit

    @property
    def free(self) -> int:
        # (``window`` inlined: this is read on every dispatch and release)
        free = (1 if self.breaker.probation else self.limit.limit) - len(self.inflight)
        return free if free > 0 else 0

    def serves(self, model: str) -> bool:
        return not model or not self.models or model in self.models

    def eligible(self, now: float) -> bool:
        """May take new work now: up, not cooling, not ejected."""
        return self.up and now >= self.cooled_until and self.breaker.allow(now)

    def next_change(self) -> float | None:
        """When ``eligible`` may turn True again by itself (a cooling or an ejection ends)."""
        times = [t for t in (self.cooled_until, self.breaker.next_change()) if t is not None]
        return max(times) if times and max(times) != float("-inf") else None


# ---------------------------------------------------------------------- Router
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
    the average lags a growing queue and herded traffic onto one replica, docs/fleet.md.)"""

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
    (docs/simulator.md, ``fleet-faults``)."""

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
