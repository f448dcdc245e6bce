"""A replica as the core sees it: the models it serves, its window, its breaker, its load.

Each varying piece is a small policy object behind one interface (each in its own module, with
the clock passed in, so the gateway and the simulator run the same ones):

- ``WindowRule`` (``core.windows``): the replica's window (requests in flight at most), in the shape
  of Netflix's concurrency-limits (``on_sample``); where the replica serves models of unequal
  weight, the window counts cost, not requests (``core.slot_costs``);
- ``Breaker`` (``core.breakers``): whether the replica may take new work now;
- ``TpotGuard`` (``core.tpot_guard``): where the TPOT guard holds the other classes off it.

A ``Replica`` also knows whether its health probe says it is up, until when an upstream's
back-pressure (429/503 with Retry-After) cools it, the last ``LoadSignals`` it reported, and the
LoRA adapters it holds loaded (``core.adapters``).
Which replica a request goes to is a ``Router``'s choice (``core.routing``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from qosgate.core.adapters import LoadedAdapters
from qosgate.core.breakers import AlwaysClosed, Breaker
from qosgate.core.signals import LoadSignals

if TYPE_CHECKING:
    from qosgate.core.request import Request
    from qosgate.core.tpot_guard import TpotGuard
    from qosgate.core.windows import WindowRule


BUDGET_OPEN = 1 << 30  # a replica's prefill budget closed to no class


@dataclass(slots=True)
class ReplicaSpec:
    name: str
    max_window: int  # the window's ceiling (adaptive) or the window (fixed)
    pausable: bool = False  # the engine can pause a running sequence and resume it (in-process)
    # the engine continues a stream from token ids (vLLM: a token-id prompt, and the ids of
    # what it generates): a stream evicted from it, or off it when it fails, goes on elsewhere
    resumes: bool = False
    models: tuple[str, ...] = ()  # model ids it serves; empty = any
    up: bool = True  # until its first health probe says otherwise
    # "adaptive" or "fixed" (``max_window`` is then the window's ceiling or the window); None:
    # the config's mode, but fixed for a pausable engine
    window_mode: str | None = None
    # the engine runs its waiting queue in the order it is sent (``Request.order``): a request
    # may then overtake this gateway's unstarted work there (``fleet.window.overtake``)
    ordered: bool = False
    # its engine publishes its KV-cache events (vLLM's --kv-events-config), fed to
    # ``Scheduler.observe_cache``: the cache-aware router's index of it follows those only
    cache_events: bool = False


class Replica:
    """One engine replica: what it serves, how much it may hold, whether it may be used now."""

    __slots__ = (
        "adapters",
        "breaker",
        "budget_closed_below",
        "charged",
        "cooled_until",
        "costs",
        "engine_share",
        "failing",
        "guard",
        "held",
        "inflight",
        "itl_s",
        "itl_seen",
        "loan_streams",
        "loans",
        "models",
        "name",
        "ordered",
        "other_prefill_tokens",
        "others_held",
        "others_inflight",
        "pausable",
        "pending",
        "preemptible",
        "prefill_tokens",
        "resumes",
        "retired",
        "room_held",
        "signals",
        "strict_streams",
        "up",
        "window_rule",
    )

    def __init__(
        self,
        name: str,
        window_rule: WindowRule,
        *,
        models: Sequence[str] = (),
        pausable: bool = False,
        breaker: Breaker | None = None,
        up: bool = True,
        guard: TpotGuard | None = None,
        ordered: bool = False,
        resumes: bool = False,
    ) -> None:
        self.name = name
        self.ordered = ordered  # its engine runs its waiting queue in ``Request.order``
        self.window_rule = window_rule
        self.models: frozenset[str] = frozenset(models)  # empty: serves any model
        self.pausable = pausable
        self.resumes = resumes
        self.breaker: Breaker = breaker if breaker is not None else AlwaysClosed()
        self.inflight: dict[str, Request] = {}
        # the window in use, in slots: each request in flight holds its model's slot cost
        # (``costs``, by model, only those above one slot), as it was when it was placed
        # (``charged``, by request id, only those above one: a weight learned since does not
        # change what a request already holds)
        self.held = 0
        self.costs: dict[str, int] = {}
        self.charged: dict[str, int] = {}
        # this fill found a request that needs more slots than are free here: the room is kept
        # for it from every request after it in order but the strict classes' (``Fleet.hold_room``)
        self.room_held = False
        self.up = up  # the health probe's word; a refused connection also sets it False
        self.retired = False  # taken out of the config (a reload): no new work, ever
        self.cooled_until = float("-inf")  # back-pressure from the engine (429/503 Retry-After)
        self.signals: LoadSignals | None = None
        self.adapters = LoadedAdapters()  # the LoRA adapters its engine holds loaded
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
    def window(self) -> int:
        """The window in force: the rule's, or one request while on probation."""
        return 1 if self.breaker.probation else self.window_rule.window

    @property
    def free(self) -> int:
        # (``window`` inlined: this is read on every dispatch and release)
        free = (1 if self.breaker.probation else self.window_rule.window) - self.held
        return free if free > 0 else 0

    def cost_of(self, model: str) -> int:
        """The slots a request of ``model`` holds of this window (one, but for the heavier
        models of a replica serving several)."""
        costs = self.costs
        return costs.get(model, 1) if costs else 1

    def fits(self, model: str) -> bool:
        """Whether a request of ``model`` has room in the window now: its slot cost is free,
        or the window holds nothing (a request costlier than the whole window still runs,
        alone)."""
        if self.held:
            return self.free >= (self.costs.get(model, 1) if self.costs else 1)
        return (1 if self.breaker.probation else self.window_rule.window) > 0

    def serves(self, model: str) -> bool:
        return not model or not self.models or model in self.models

    def eligible(self, now: float) -> bool:
        """May take new work now: up, not cooling, not ejected, not retired."""
        return (self.up and now >= self.cooled_until and self.breaker.allow(now)
                and not self.retired)

    def next_change(self) -> float | None:
        """When ``eligible`` may turn True again by itself (a cooling or an ejection ends)."""
        times = [t for t in (self.cooled_until, self.breaker.next_change()) if t is not None]
        return max(times) if times and max(times) != float("-inf") else None
