"""The virtual-time driver: one ``Scheduler`` (the core the gateway runs) in front of one or more
``SimEngine`` replicas (the engine model the gateway's in-process engine runs), fed a workload.

Nothing here decides who runs: arrivals go to ``Scheduler.submit``, scheduler timers to ``tick``,
engine first tokens and finishes to ``first_token``/``complete``, what a health probe finds to
``observe``, and a replica's failures to ``attempt_failed``/``fail``, as the gateway's driver and
upstream client hand them over; the driver only carries out the core's decisions on the engines
(``Dispatch`` -> ``add``/``resume``, ``Preempt`` -> ``pause`` or ``abort``) and records each
``Finished`` request.

Time. Events are handled in time order: the next external event (arrival, scheduler timer,
sampling instant, health probe, fault) bounds how far each engine may run
(``SimEngine.advance(until=...)``, the fast path that computes stretches of pure decode steps in
closed form). An engine stops at the end of the first step that yields a first token or a finish;
that step's events are held until the global clock reaches them, then delivered. Every replica has
its own clock (the end of its last step); work given to a busy replica joins its next step, work
given to an idle one starts at once. Engines are advanced independently between external events.
That is exact because an engine's event only ever frees capacity on its own replica: a request
waits in qosgate only while every window it may use is full, so the slot freed by a finish on
replica A goes to A (the core never holds a request while a replica it may use has room, and a
paused request resumes only where it was paused).

Windows and preemption (the choices, and why):

- Each replica's window (the core's ``ReplicaSpec.capacity``) is given by the scenario (``auto``:
  what the engine can run at once). qosgate holds the queue and orders it, while the engine's
  own waiting queue only holds what is dispatched but not yet admitted (prefill budget, KV).
- Replicas are *pausable* by default, as the gateway's in-process engine declares: the simulated
  engine pauses a sequence at a token boundary and resumes it with its KV intact, so the core's
  ``Preempt`` is a pause. A replica declared not pausable models an upstream server (vLLM over
  HTTP): the core may then only pull back, by abort, a request that has not produced its first
  token.
- ``engine-priority`` ("engine priority alone"): qosgate passes everything straight through
  (``fifo``, a fixed window of 2**30, no reserved share and no prefill budget, so nothing ever
  queues in qosgate) and the engine's own vLLM-priority queue orders by the request's level
  (smaller first, with its priority preemption).

Health and faults (a fleet that fails). Every ``probe_interval`` the driver probes every replica,
as the gateway's driver does, and hands the core what it found: ``observe(up=..., signals=...)``
with the engine's own load figures (running, waiting, KV use, preemptions; what a scrape of
vLLM's ``/metrics`` gives). A scenario's faults act on the simulated engines only; the core
learns of them by the same facts the gateway's upstream client reports:

- ``die`` at t: the engine process is gone, with everything in it. A request on it that had
  streamed to its client fails (``fail(..., "upstream_disconnected")``, charged what it streamed);
  one that had not is ``attempt_failed(..., "upstream_disconnected")``, and the core retries it
  elsewhere within its retry budget -- as the upstream client reports a connection that breaks
  after the request went out. A request dispatched to a dead replica is refused at once:
  ``attempt_failed(..., "upstream_unreachable", unreachable=True)`` (a refused connect). A
  request paused on it when it died lost its state: the core holds paused requests in its queue,
  so it is told when it resumes it (a stream that had started fails, one that had not is retried).
  Until ``until_s`` the probes find it down; from then on the replica is up again, empty, and the
  next probe tells the core.
- ``slow`` from t (until ``until_s``): every engine step that starts then takes ``factor`` times
  as long (each time coefficient of the engine profile multiplied).
"""

from __future__ import annotations

import contextlib
import heapq
import math
import zlib
from collections import Counter
from collections.abc import Callable, Coroutine, Generator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from qosgate.config import QosConfig
from qosgate.core import (
    POLICY_NAMES,
    Decision,
    Dispatch,
    Finished,
    Preempt,
    ReplicaSpec,
    Scheduler,
    State,
)
from qosgate.core.ledger import LeasedLedger
from qosgate.core.limits import FixedLimit
from qosgate.core.signals import LoadSignals
from qosgate.core.snapshot import Snapshot
from qosgate.models.simmodel import EngineProfile, SimEngine
from qosgate.models.step import EvictEvent, FinishEvent, SeqSpec, TokenEvent
from qosgate.runtime.shared_state import MemoryStore, SharedState, prime
from qosgate.sim.workload import Arrival, Workload

PASSTHROUGH_WINDOW = 1 << 30
SIM_POLICIES: tuple[str, ...] = (*POLICY_NAMES, "engine-priority")
INF = math.inf
DISCONNECTED = "upstream_disconnected"  # the upstream client's reason for a broken connection
UNREACHABLE = "upstream_unreachable"  # ... and for a refused connect


@dataclass(slots=True, frozen=True)
class PolicySetup:
    """A simulated policy: the core policy, the engine's own queue, and the qosgate window."""

    name: str
    core_policy: str
    engine_queue: Literal["fcfs", "priority"]
    passthrough: bool  # window = PASSTHROUGH_WINDOW: the engine holds the whole queue


EngineQueue = Literal["auto", "fcfs", "priority"]


def policy_setup(name: str, engine_queue: EngineQueue = "auto") -> PolicySetup:
    """``engine_queue="auto"``: the engine's own queue is FCFS under ``fifo`` (no priorities
    anywhere: the baseline) and vLLM-priority under the class-aware policies, which forward
    qosgate's order as the engine priority (as the gateway does, ``core.engine_order``);
    ``engine-priority`` always uses the engine's priority queue."""
    if name == "engine-priority":
        return PolicySetup(name, "fifo", "priority", True)
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(SIM_POLICIES)}")
    if engine_queue == "auto":
        return PolicySetup(name, name, "fcfs" if name == "fifo" else "priority", False)
    return PolicySetup(name, name, engine_queue, False)


@dataclass(slots=True, frozen=True)
class ReplicaPlan:
    """One simulated replica: its name, engine profile, qosgate window, and whether it pauses."""

    name: str
    profile: EngineProfile
    window: int
    pausable: bool = True
    # the core's window mode for it: "adaptive" (``window`` is then its ceiling) or "fixed";
    # None: the core's default (fixed for a pausable replica, ``fleet.window.mode`` otherwise)
    window_mode: Literal["fixed", "adaptive"] | None = None


Spread = Literal["round-robin", "hash", "skewed"]
SPREADS: tuple[str, ...] = ("round-robin", "hash", "skewed")


@dataclass(slots=True, frozen=True)
class GatewayPlan:
    """N gateway instances in front of the one fleet (see ``docs/simulator.md``).

    ``spread``: how arrivals reach them -- ``round-robin`` (arrival k to gateway k mod N, as a
    load balancer), ``hash`` (every request of a tenant to gateway crc32(tenant) mod N, as a
    balancer hashing the API key) or ``skewed`` (a tenant listed in ``reach`` only reaches those
    gateway indices, taken mod N, in turn; the others reach all in turn). ``shared``: with N > 1,
    tenant state (limits, fair-share counters) goes through ``runtime.shared_state.SharedState``
    over one ``MemoryStore`` whose calls answer ``sync_delay`` virtual seconds later, each
    instance syncing ``sync_interval`` after its last sync ended; off, each instance keeps its own
    limits and counters. One gateway never uses the shared state (nothing to share): it is
    exactly the single-gateway simulator."""

    count: int = 1
    spread: Spread = "round-robin"
    reach: tuple[tuple[str, tuple[int, ...]], ...] = ()
    shared: bool = True
    sync_interval: float = 0.05
    sync_delay: float = 0.0

    @property
    def sharing(self) -> bool:
        return self.count > 1 and self.shared


FaultKind = Literal["die", "slow"]


@dataclass(slots=True, frozen=True)
class FaultPlan:
    """``die``: the replica's engine is gone from ``at`` (with everything in it) until ``until``
    (None: for good). ``slow``: its steps take ``factor`` x as long from ``at`` until ``until``."""

    replica: str
    kind: FaultKind
    at: float
    until: float | None = None
    factor: float = 1.0


@dataclass(slots=True)
class RequestRecord:
    """One request's life, as the metrics need it (times in virtual seconds)."""

    rid: str
    stream: int
    service_class: str
    tenant: str
    state: str
    reason: str
    arrival: float
    first_token_at: float | None
    finished_at: float
    prompt_tokens: int
    output_tokens: int  # delivered (completed), or generated before the end (others)
    target_output: int  # the workload's output length
    preemptions: int
    promotions: int
    win_prefilled: bool  # its prefill was done by the end of the arrival window
    win_output: int  # output tokens generated by the end of the arrival window
    replica: str = ""  # the last replica it was dispatched to ("" if never)
    failed_attempts: int = 0  # its attempts that failed before its first token
    gateway: int = 0  # the gateway instance it arrived at
    # a client honouring Retry-After: the request whose refusal this attempt retries ("" for a
    # first attempt) and which attempt it is (0 first)
    retry_of: str = ""
    attempt: int = 0


@dataclass(slots=True, frozen=True)
class Sample:
    t: float
    queued: tuple[int, ...]  # qosgate queue per class level
    inflight: int  # dispatched/running per qosgate
    engine_running: int
    engine_waiting: int
    engine_paused: int
    kv_usage: float  # mean over the replicas that are up
    replicas_up: int = 0  # replicas whose engine is alive
    windows: tuple[int, ...] = ()  # each replica's window in the core now (adaptive ones move)


@dataclass(slots=True)
class RunResult:
    policy: str
    classes: tuple[str, ...]
    records: list[RequestRecord]  # in arrival order
    samples: list[Sample]
    window_end: float  # end of the arrival window: the measurement window is [0, window_end]
    makespan: float  # last terminal event
    arrivals: int
    engine: dict[str, float] = field(default_factory=dict)
    # engine counters at the end of the arrival window (cross-check of the per-request tokens)
    engine_window: dict[str, float] = field(default_factory=dict)
    outcomes: dict[str, int] = field(default_factory=dict)
    pauses: int = 0  # core preemptions carried out as a pause (KV kept)
    aborts: int = 0  # core preemptions carried out as an abort (before the first token)
    # a first token or finish produced in the step during which qosgate paused the sequence,
    # reported when it is resumed (see _preempt)
    late_finishes: int = 0
    unfinished: int = 0  # live at the end (a deadlock): must be 0
    scheduler_calls: int = 0
    # the fleet: per replica (profile, window, ejections...), the core's failed attempts and
    # retries by reason, and the faults carried out
    fleet: dict[str, object] = field(default_factory=dict)
    gateways: int = 1
    # per gateway: the engines' own evictions (KV preemptions) of its requests' sequences
    gateway_evictions: tuple[int, ...] = (0,)
    # the shared state, with N > 1 gateways sharing it: syncs carried out per gateway
    shared: dict[str, object] = field(default_factory=dict)


@dataclass(slots=True, frozen=True)
class SimSetup:
    cfg: QosConfig
    profile: EngineProfile
    replicas: int
    window: int
    workload: Workload
    sample_interval: float
    engine_queue: EngineQueue = "auto"
    # the replicas one by one (heterogeneous fleets); empty: ``replicas`` x ``profile``/``window``
    fleet: tuple[ReplicaPlan, ...] = ()
    faults: tuple[FaultPlan, ...] = ()
    probe_interval: float = 1.0  # the gateway driver's default health cadence
    gateways: GatewayPlan = GatewayPlan()
    # clients that honour a refusal's Retry-After: each refused request is sent again that many
    # seconds later, up to this many times (0: clients take the refusal as final)
    retries: int = 0

    def plans(self) -> tuple[ReplicaPlan, ...]:
        if self.fleet:
            return self.fleet
        return tuple(
            ReplicaPlan(f"r{i}", self.profile, self.window) for i in range(self.replicas)
        )


def passthrough_config(cfg: QosConfig) -> QosConfig:
    """``cfg`` with nothing that would hold a request in qosgate under ``engine-priority``: no
    share of a window reserved for a class, no prefill budget next to realtime streams (the
    engine's own priority queue is the whole policy there)."""
    fleet = cfg.fleet
    if "prefill_budget_tokens" in type(fleet).model_fields:
        fleet = fleet.model_copy(update={"prefill_budget_tokens": None})
    classes = tuple(
        c.model_copy(update={"reserved_share": 0.0})
        if "reserved_share" in type(c).model_fields
        else c
        for c in cfg.classes
    )
    return cfg.model_copy(update={"fleet": fleet, "classes": classes})


def scaled(profile: EngineProfile, factor: float) -> EngineProfile:
    """``profile`` with every time coefficient x ``factor``: each step lasts ``factor`` x longer."""
    if factor == 1.0:
        return profile
    return profile.model_copy(
        update={
            "step_fixed_s": profile.step_fixed_s * factor,
            "prefill_s_per_token": profile.prefill_s_per_token * factor,
            "decode_s_per_ctx_token": profile.decode_s_per_ctx_token * factor,
            "decode_s_per_seq": profile.decode_s_per_seq * factor,
        }
    )


class _Rep:
    __slots__ = (
        "alive",
        "base",
        "buf",
        "clock",
        "engine",
        "factor",
        "lost",
        "name",
        "parked",
        "paused",
        "queue",
        "retired",
        "seqs",
        "stuck",
        "told_up",
    )

    def __init__(
        self, name: str, profile: EngineProfile, queue: Literal["fcfs", "priority"]
    ) -> None:
        self.name = name
        self.base = profile
        self.queue: Literal["fcfs", "priority"] = queue
        self.factor = 1.0
        self.engine = SimEngine(profile, queue)
        self.clock = 0.0  # end of the engine's last step
        self.buf: list[TokenEvent | FinishEvent] | None = None  # events at ``clock``, undelivered
        self.stuck = False  # has work but cannot step until something changes
        # events of the step under way when qosgate paused the sequence: delivered on resume
        self.parked: dict[str, list[TokenEvent | FinishEvent]] = {}
        self.seqs: dict[str, None] = {}  # requests whose sequence is in this engine (in order)
        self.paused: set[str] = set()  # ... of which paused by qosgate
        # paused here when the engine died: rid -> (had streamed, tokens generated)
        self.lost: dict[str, tuple[bool, int]] = {}
        self.alive = True
        self.told_up = True  # what the core was last told (a probe, or a refused connect)
        self.retired: list[SimEngine] = []  # engines lost when it died (their counters count)

    def engines(self) -> list[SimEngine]:
        return [*self.retired, self.engine]

    def drop(self, rid: str) -> None:
        if self.buf:
            self.buf = [e for e in self.buf if e.seq_id != rid] or None
        self.parked.pop(rid, None)

    def take(self, rid: str) -> list[TokenEvent | FinishEvent]:
        """Remove and return ``rid``'s undelivered events."""
        mine = [e for e in self.buf or () if e.seq_id == rid]
        if mine:
            self.drop(rid)
        return mine

    def finish_of(self, rid: str) -> FinishEvent | None:
        for e in [*(self.buf or ()), *self.parked.get(rid, ())]:
            if isinstance(e, FinishEvent) and e.seq_id == rid:
                return e
        return None

    def generated(self, rid: str) -> int:
        """Tokens the engine generated for ``rid`` so far (0 if it does not know it)."""
        try:
            return self.engine.generated(rid)
        except KeyError:
            fin = self.finish_of(rid)
            return fin.completion_tokens if fin is not None else 0

    def forget(self, rid: str) -> None:
        self.seqs.pop(rid, None)
        self.paused.discard(rid)


ProgressFn = Callable[[float, int], None]


class _Pause:
    """What ``MemoryStore``'s sleep awaits in the simulator: the sync coroutine yields it to the
    event loop, which resumes the coroutine ``delay`` virtual seconds later (no asyncio)."""

    __slots__ = ("delay",)

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __await__(self) -> Generator[_Pause, None, None]:
        yield self


def _virtual_sleep(delay: float) -> _Pause:
    return _Pause(delay)


SyncCoro = Coroutine[object, None, None]


class _Run:
    def __init__(self, setup: SimSetup, policy: str) -> None:
        ps = policy_setup(policy, setup.engine_queue)
        self.setup = setup
        self.policy = policy
        self.plans = setup.plans()
        self.passthrough = ps.passthrough
        cfg = passthrough_config(setup.cfg) if ps.passthrough else setup.cfg
        gp = setup.gateways
        self.gplan = gp
        self.now = 0.0  # the global virtual clock (the shared store's clock)
        # one Scheduler per gateway instance: its own queue, replica objects and windows
        self.gws: list[Scheduler] = []
        self.shared: list[SharedState] = []
        store = MemoryStore(gp.sync_delay, lambda: self.now, _virtual_sleep)
        for g in range(max(1, gp.count)):
            ledger = LeasedLedger() if gp.sharing else None
            sched = Scheduler(cfg, ps.core_policy, ledger=ledger)
            for plan in self.plans:
                if ps.passthrough:  # a fixed window nothing fills: the engine holds the queue
                    spec = ReplicaSpec(plan.name, PASSTHROUGH_WINDOW, pausable=plan.pausable)
                    sched.add_replica(spec, FixedLimit(PASSTHROUGH_WINDOW))
                else:  # the window the config asks for, as the gateway's
                    sched.add_replica(
                        ReplicaSpec(
                            plan.name, plan.window, pausable=plan.pausable,
                            window=plan.window_mode, ordered=ps.engine_queue == "priority",
                        )
                    )
            self.gws.append(sched)
            if ledger is not None:
                self.shared.append(
                    SharedState(store, ledger, lambda: self.now, sched.policy.root, f"gw{g}",
                                gp.sync_interval)
                )
        self.sched = self.gws[0]
        self.gw_of: dict[str, int] = {}  # request -> the gateway it arrived at
        self.evictions = [0] * len(self.gws)
        self._route_n = 0
        self._route_tenant: dict[str, int] = {}
        self._reach = {t: tuple(sorted({i % len(self.gws) for i in idx}))
                       for t, idx in gp.reach}
        self._tenant_of: dict[int, str] = {}
        # syncs under way or due: (t, gateway, order, coroutine or None = start a new one)
        self.syncs: list[tuple[float, int, int, SyncCoro | None]] = []
        self._sync_seq = 0
        for g, sh in enumerate(self.shared):
            # as the gateway's startup: limiters for the configured tenants, one sync before
            # serving (here: before t = 0, whatever the store's delay), then one every interval
            prime(sh.ledger, [(t.name, t.limits) for t in cfg.tenants], 0.0)
            coro = sh.sync()
            with contextlib.suppress(StopIteration):
                while True:
                    coro.send(None)
            self._push_sync(gp.sync_interval, g, None)
        self.reps = {p.name: _Rep(p.name, p.profile, ps.engine_queue) for p in self.plans}
        self.rep_list = list(self.reps.values())
        self.arr: dict[str, Arrival] = {a.rid: a for a in setup.workload.arrivals}
        # attempts of refused requests, due at their Retry-After: (t, order, arrival)
        self.retry_due: list[tuple[float, int, Arrival]] = []
        self.retry_arrivals: list[Arrival] = []
        self.attempt_of: dict[str, tuple[str, int]] = {}  # retry -> (first request, attempt)
        self.records: dict[str, RequestRecord] = {}
        self.samples: list[Sample] = []
        self.window_end = setup.workload.duration
        self.snapshot: dict[str, tuple[bool, int]] | None = None
        self.engine_window: dict[str, float] = {}
        self.started: set[str] = set()  # requests whose first token went to the client
        self.last_rep: dict[str, str] = {}
        self.late_finishes = 0
        self.pauses = 0
        self.aborts = 0
        self.calls = 0
        self.last_finish = 0.0
        # fault instants in time order: (t, order, action, replica, factor)
        ev: list[tuple[float, int, str, str, float]] = []
        for k, f in enumerate(setup.faults):
            if f.replica not in self.reps:
                raise ValueError(f"fault on unknown replica {f.replica!r}")
            if f.kind == "die":
                ev.append((f.at, k, "die", f.replica, 1.0))
                if f.until is not None:
                    ev.append((f.until, k, "revive", f.replica, 1.0))
            else:
                ev.append((f.at, k, "slow", f.replica, f.factor))
                if f.until is not None:
                    ev.append((f.until, k, "slow", f.replica, 1.0))
        ev.sort()
        self.fault_events = ev
        self.faults_done: list[dict[str, object]] = []

    # ------------------------------------------------------------------ gateways
    def _s(self, rid: str) -> Scheduler:
        """The gateway instance that holds ``rid``."""
        return self.gws[self.gw_of.get(rid, 0)]

    def _route(self, stream: int) -> int:
        """The gateway the next arrival (of ``stream``) reaches (see ``GatewayPlan``)."""
        n = len(self.gws)
        if n == 1:
            return 0
        spread = self.gplan.spread
        if spread == "round-robin":
            self._route_n += 1
            return (self._route_n - 1) % n
        tenant = self._tenant_of.get(stream)
        if tenant is None:
            inputs = self.setup.workload.inputs[stream]
            tenant = self._tenant_of[stream] = self.sched.classifier.classify(inputs).tenant
        if spread == "hash":
            return zlib.crc32(tenant.encode()) % n
        reach = self._reach.get(tenant) or tuple(range(n))
        k = self._route_tenant.get(tenant, 0)
        self._route_tenant[tenant] = k + 1
        return reach[k % len(reach)]

    def _push_sync(self, t: float, g: int, coro: SyncCoro | None) -> None:
        self._sync_seq += 1
        heapq.heappush(self.syncs, (t, g, self._sync_seq, coro))

    def _sync_step(self, now: float) -> None:
        """Start or resume one gateway's sync: it runs until its next store call (answered
        ``sync_delay`` later) or to its end (the next one starts ``sync_interval`` after)."""
        _, g, _, coro = heapq.heappop(self.syncs)
        if coro is None:
            coro = self.shared[g].sync()
        self.calls += 1
        try:
            pause = coro.send(None)
        except StopIteration:
            self._push_sync(now + self.gplan.sync_interval, g, None)
            return
        assert isinstance(pause, _Pause)
        self._push_sync(now + pause.delay, g, coro)

    # ------------------------------------------------------------------ decisions -> engines
    def apply(self, decisions: list[Decision], now: float) -> None:
        todo = decisions
        while todo:
            more: list[Decision] = []
            for d in todo:
                if isinstance(d, Dispatch):
                    more += self._dispatch(d, now)
                elif isinstance(d, Preempt):
                    self._preempt(d, now)
                else:
                    self._finished(d, now)
            todo = more

    def _touch(self, rep: _Rep, now: float) -> None:
        if rep.clock < now:  # idle or stuck: a busy engine's clock is never behind ``now``
            rep.clock = now
        rep.stuck = False

    def _call_lost(self, rid: str, now: float, had_streamed: bool, tokens: int) -> list[Decision]:
        """The engine call of ``rid`` broke (its replica died): a stream that had started fails,
        charged what it streamed; an attempt that had sent nothing the core may retry."""
        self.calls += 1
        if had_streamed:
            return self._s(rid).fail(rid, now, DISCONNECTED, tokens)
        return self._s(rid).attempt_failed(rid, now, DISCONNECTED)

    def _dispatch(self, d: Dispatch, now: float) -> list[Decision]:
        rep = self.reps[d.replica]
        rid = d.req.id
        self.last_rep[rid] = rep.name
        lost = rep.lost.pop(rid, None)
        if lost is not None:  # paused here when the engine died: its state is gone
            return self._call_lost(rid, now, *lost)
        if not rep.alive:  # a refused connect: nothing was sent
            self.calls += 1
            rep.told_up = False
            if rid in self.started:  # cannot happen: a stream resumes only where it paused
                return self._s(rid).fail(rid, now, UNREACHABLE)
            return self._s(rid).attempt_failed(rid, now, UNREACHABLE, unreachable=True)
        self._touch(rep, now)
        if d.resume:
            if rid not in rep.seqs:  # not in this engine (cannot happen): its state is gone
                return self._call_lost(rid, now, rid in self.started, 0)
            rep.paused.discard(rid)
            parked = rep.parked.pop(rid, None)
            if not parked:
                rep.engine.resume(rid)
                return []
            # the engine produced these in the step during which qosgate paused the sequence:
            # they are reported now, when qosgate lets it run again
            self.late_finishes += 1
            out: list[Decision] = []
            fin = None
            for e in parked:
                if isinstance(e, TokenEvent):
                    self.calls += 1
                    self.started.add(rid)
                    out += self._s(rid).first_token(rid, now)
                else:
                    fin = e
            if fin is None:
                rep.engine.resume(rid)
            else:
                self.calls += 1
                out += self._s(rid).complete(rid, now, fin.completion_tokens)
            return out
        a = self.arr[rid]
        spec = SeqSpec(
            rid,
            a.prompt,
            a.max_tokens,
            target_output_tokens=a.output,
            # engine-priority: the client's own priority (its class's level), as a client
            # talking to vLLM directly would send it; else qosgate's order (``engine_order``)
            engine_priority=d.req.level if self.passthrough or d.req.order is None
            else d.req.order,
        )
        try:
            rep.engine.add(spec)
        except ValueError:
            self.calls += 1
            return self._s(rid).fail(rid, now, "engine_rejected")
        rep.seqs[rid] = None
        return []

    def _preempt(self, d: Preempt, now: float) -> None:
        rep = self.reps[d.replica]
        rid = d.req.id
        self._touch(rep, now)
        if d.pause:
            self.pauses += 1
            rep.paused.add(rid)
            under_way = rep.take(rid)
            if under_way:  # its step is already under way: what it produced waits for resume
                rep.parked[rid] = under_way
            if not any(isinstance(e, FinishEvent) for e in under_way):
                rep.engine.pause(rid)
        else:  # no first token yet: drop it from the engine, it is re-dispatched later
            self.aborts += 1
            rep.engine.abort(rid)
            rep.drop(rid)
            rep.forget(rid)

    def _finished(self, d: Finished, now: float) -> None:
        req = d.req
        rid = req.id
        a = self.arr[rid]
        out = req.output_tokens
        if req.state is not State.COMPLETED and req.replica is not None:
            rep = self.reps.get(req.replica)
            if rep is not None:  # e.g. timed out while paused: free its KV in the engine
                lost = rep.lost.pop(rid, None)
                if lost is not None:
                    out = max(out, lost[1])
                else:
                    fin = rep.finish_of(rid)
                    if fin is not None:
                        out = fin.completion_tokens
                    else:
                        with contextlib.suppress(KeyError):
                            out = rep.engine.generated(rid)
                rep.engine.abort(rid)
                rep.drop(rid)
        if req.replica is not None:
            rep = self.reps.get(req.replica)
            if rep is not None:
                rep.forget(rid)
        if now <= self.window_end or self.snapshot is None:
            win = (req.first_token_at is not None, out)
        else:
            win = self.snapshot.get(rid, (False, 0))
        self.started.discard(rid)
        retry_of, attempt = self.attempt_of.get(rid, ("", 0))
        self.records[rid] = RequestRecord(
            rid=rid,
            stream=a.stream,
            service_class=req.service_class,
            tenant=req.tenant,
            state=req.state.value,
            reason=req.reason,
            arrival=req.arrival,
            first_token_at=req.first_token_at,
            finished_at=now,
            prompt_tokens=a.prompt,
            output_tokens=out,
            target_output=a.output,
            preemptions=req.preemptions,
            promotions=req.promotions,
            win_prefilled=win[0],
            win_output=win[1],
            replica=self.last_rep.pop(rid, ""),
            failed_attempts=req.failures,
            gateway=self.gw_of.get(rid, 0),
            retry_of=retry_of,
            attempt=attempt,
        )
        if now > self.last_finish:
            self.last_finish = now
        if req.state is State.REJECTED and req.retry_after is not None:
            self._retry_later(a, now + req.retry_after)

    def _retry_later(self, a: Arrival, t: float) -> None:
        """The client of a refused request sends it again at ``t`` (its Retry-After), while it
        has attempts left: a new request with its own outcome, linked to the first."""
        first, attempt = self.attempt_of.get(a.rid, (a.rid, 0))
        if attempt >= self.setup.retries:
            return
        again = replace(a, t=t, rid=f"{first}.retry{attempt + 1}")
        self.arr[again.rid] = again
        self.attempt_of[again.rid] = (first, attempt + 1)
        self.retry_arrivals.append(again)
        heapq.heappush(self.retry_due, (t, len(self.retry_arrivals), again))

    # ------------------------------------------------------------------ engines -> scheduler
    def _deliver(self, rep: _Rep) -> None:
        t = rep.clock
        self.now = t
        while rep.buf:
            ev = rep.buf.pop(0)
            self.calls += 1
            sched = self._s(ev.seq_id)
            if isinstance(ev, TokenEvent):
                self.started.add(ev.seq_id)
                self.apply(sched.first_token(ev.seq_id, t), t)
            else:
                self.apply(sched.complete(ev.seq_id, t, ev.completion_tokens), t)
        rep.buf = None

    # ------------------------------------------------------------------ health and faults
    def _probe(self, now: float) -> None:
        """Every replica probed at once, as the gateway's driver does: up or not, and, from a
        live engine, its own load figures (what a scrape of vLLM's /metrics reports). Every
        gateway instance reads the same figures (each scrapes the same engines)."""
        for rep in self.rep_list:
            sig = None
            if rep.alive:
                m = rep.engine.metrics()
                sig = LoadSignals(
                    at=now,
                    running=m.num_running,
                    waiting=m.num_waiting,
                    kv_usage=m.kv_usage,
                    preemptions_total=m.preemptions_total,
                    itl_seconds_total=m.itl_s_total,
                    itl_tokens_total=m.itl_tokens_total,
                )
            rep.told_up = rep.alive
            for sched in self.gws:
                self.calls += 1
                if sig is not None:
                    self.apply(sched.observe(rep.name, now, up=True, signals=sig), now)
                else:
                    self.apply(sched.observe(rep.name, now, up=False), now)

    def _fault(self, now: float, action: str, name: str, factor: float) -> None:
        rep = self.reps[name]
        done: dict[str, object] = {"t": now, "replica": name, "action": action}
        if action == "slow":
            done["factor"] = factor
        self.faults_done.append(done)
        if action == "slow":
            rep.factor = factor
            rep.engine.profile = scaled(rep.base, factor)
            return
        if action == "revive":  # restarted, empty; the next probe tells the core
            if not rep.alive:
                rep.alive = True
                self._touch(rep, now)
            return
        if not rep.alive:
            return
        # die: the engine and everything in it are gone
        rep.alive = False
        victims = [(rid, rid in rep.paused, rep.generated(rid)) for rid in rep.seqs]
        rep.retired.append(rep.engine)
        rep.engine = SimEngine(scaled(rep.base, rep.factor), rep.queue)
        rep.buf = None
        rep.parked.clear()
        rep.seqs.clear()
        rep.paused.clear()
        rep.stuck = False
        if rep.clock < now:
            rep.clock = now
        for rid, paused, tokens in victims:
            if paused:  # the core holds it queued: told when it resumes it here
                rep.lost[rid] = (rid in self.started, tokens)
            else:
                self.apply(self._call_lost(rid, now, rid in self.started, tokens), now)

    # ------------------------------------------------------------------ observation
    def _take_snapshot(self) -> None:
        snap: dict[str, tuple[bool, int]] = {}
        for rep in self.rep_list:
            for rid in rep.seqs:
                gen = rep.generated(rid)
                snap[rid] = (rid in self.started or gen > 0, gen)
            for rid, (had, gen) in rep.lost.items():
                snap[rid] = (had or gen > 0, gen)
        self.snapshot = snap
        engines = [e for r in self.rep_list for e in r.engines()]
        self.engine_window = {
            "generated_tokens": float(sum(e.metrics().generation_tokens_total for e in engines)),
            "busy_s": sum(e.metrics().busy_s_total for e in engines),
        }

    def _sample(self, t: float) -> None:
        running = waiting = paused = up = 0
        kv = 0.0
        for rep in self.rep_list:
            m = rep.engine.metrics()
            running += m.num_running
            waiting += m.num_waiting
            paused += m.num_paused
            if rep.alive:
                up += 1
                kv += m.kv_usage
        views = [s.snapshot(t) for s in self.gws]
        view = views[0]
        queued = [c.queued for c in view.classes]
        windows = [r.window for r in view.replicas]
        inflight = sum(c.inflight for c in view.classes)
        for v in views[1:]:  # several gateways: their queues and windows summed
            queued = [q + c.queued for q, c in zip(queued, v.classes, strict=True)]
            windows = [w + r.window for w, r in zip(windows, v.replicas, strict=True)]
            inflight += sum(c.inflight for c in v.classes)
        self.samples.append(
            Sample(
                t,
                tuple(queued),
                inflight,
                running,
                waiting,
                paused,
                kv / up if up else 0.0,
                up,
                tuple(windows),
            )
        )

    # ------------------------------------------------------------------ the event loop
    def run(self, progress: ProgressFn | None = None) -> RunResult:
        gws = self.gws
        syncs = self.syncs
        arrivals = self.setup.workload.arrivals
        inputs = self.setup.workload.inputs
        n = len(arrivals)
        reps = self.rep_list
        interval = self.setup.sample_interval
        probe_every = self.setup.probe_interval
        faults = self.fault_events
        fi = 0
        next_sample = 0.0
        next_probe = 0.0
        win_end = self.window_end
        snap_due = True
        records = self.records
        i = 0
        now = 0.0
        retry_due = self.retry_due
        sent = 0  # requests submitted so far, first attempts and retries
        while True:
            t_arr = arrivals[i].t if i < n else INF
            if retry_due and retry_due[0][0] < t_arr:
                t_arr = retry_due[0][0]
            t_tmr = INF
            g_tmr = 0
            for g, s in enumerate(gws):
                nt = s.next_timer()
                if nt is not None and nt < t_tmr:
                    t_tmr, g_tmr = nt, g
            # arrivals to come, or requests without an outcome
            live = i < n or bool(retry_due) or len(records) < sent
            t_smp = next_sample if live else INF
            t_prb = next_probe if live else INF
            t_flt = faults[fi][0] if live and fi < len(faults) else INF
            t_win = win_end if snap_due else INF
            t_syn = syncs[0][0] if live and syncs else INF
            t_ext = min(t_arr, t_tmr, t_smp, t_prb, t_flt, t_win, t_syn)
            best: _Rep | None = None
            best_t = INF
            for rep in reps:
                if rep.buf is None and not rep.stuck:
                    eng = rep.engine
                    while rep.clock < t_ext and eng.has_work():
                        adv = eng.advance(t_ext, rep.clock)
                        rep.clock = adv.now
                        if adv.events:
                            evs: list[TokenEvent | FinishEvent] = []
                            for _, e in adv.events:
                                if isinstance(e, EvictEvent):
                                    self.evictions[self.gw_of.get(e.seq_id, 0)] += 1
                                else:
                                    evs.append(e)
                            if evs:
                                rep.buf = evs
                                break
                        elif adv.steps == 0:
                            rep.stuck = True
                            break
                if rep.buf is not None and rep.clock < best_t:
                    best, best_t = rep, rep.clock
            if best is not None and best_t <= t_ext:
                now = best_t
                self._deliver(best)
                continue
            if t_ext == INF:
                break
            if i >= n and not retry_due and t_tmr == INF and len(records) >= sent:
                break  # only sampling/probe/snapshot instants are left and nothing lives
            if (
                i >= n
                and not retry_due
                and t_tmr == INF
                and t_win == INF
                and t_flt == INF
                and all(r.buf is None and (r.stuck or not r.engine.has_work()) for r in reps)
                and all(r.alive == r.told_up for r in reps)
            ):
                break  # live requests but nothing can move: a deadlock (reported as unfinished)
            now = t_ext
            self.now = now
            if t_win == now:
                snap_due = False
                self._take_snapshot()
            elif t_smp == now:
                self._sample(now)
                next_sample += interval
                if progress is not None:
                    progress(now, len(records))
            elif t_prb == now:
                self._probe(now)
                next_probe += probe_every
            elif t_flt == now:
                _, _, action, name, factor = faults[fi]
                fi += 1
                self._fault(now, action, name, factor)
            elif t_tmr == now:
                self.calls += 1
                self.apply(gws[g_tmr].tick(now), now)
            elif t_syn == now and t_arr != now:
                self._sync_step(now)
            else:
                if retry_due and (i >= n or retry_due[0][0] < arrivals[i].t):
                    a = heapq.heappop(retry_due)[2]
                else:
                    a = arrivals[i]
                    i += 1
                sent += 1
                self.calls += 2
                g = self._route(a.stream)
                self.gw_of[a.rid] = g
                sched = gws[g]
                req = sched.make_request(a.rid, inputs[a.stream], now, a.prompt, a.max_tokens)
                self.apply(sched.submit(req, now), now)
        if snap_due:  # everything ended before the end of the arrival window
            self._take_snapshot()
        if progress is not None:
            progress(now, len(records))
        return self._result(sent, now)

    def _result(self, n: int, now: float) -> RunResult:
        totals: dict[str, float] = {}
        for eng in [e for r in self.rep_list for e in r.engines()]:
            m = eng.metrics()
            for key, v in (
                ("steps", m.steps_total),
                ("busy_s", m.busy_s_total),
                ("kv_evictions", m.preemptions_total),
                ("prompt_tokens", m.prompt_tokens_total),
                ("generated_tokens", m.generation_tokens_total),
            ):
                totals[key] = totals.get(key, 0.0) + v
        ledger: Counter[str] = Counter()
        for sched in self.gws:
            for (_cls, _tenant, outcome, _reason), count in sched.outcomes.items():
                ledger[outcome] += count
        arrivals = (*self.setup.workload.arrivals, *self.retry_arrivals)
        records = [self.records[a.rid] for a in arrivals if a.rid in self.records]
        views = [s.snapshot(now) for s in self.gws]
        unfinished = sum(v.queued_total + sum(c.inflight for c in v.classes) for v in views)
        return RunResult(
            policy=self.policy,
            classes=tuple(c.name for c in self.sched.classes),
            records=records,
            samples=self.samples,
            window_end=self.window_end,
            makespan=self.last_finish,
            arrivals=n,
            engine={k: float(v) for k, v in sorted(totals.items())},
            engine_window=self.engine_window,
            outcomes=dict(sorted(ledger.items())),
            pauses=self.pauses,
            aborts=self.aborts,
            late_finishes=self.late_finishes,
            unfinished=unfinished,
            scheduler_calls=self.calls,
            fleet=self._fleet(views),
            gateways=len(self.gws),
            gateway_evictions=tuple(self.evictions),
            shared=(
                {"syncs": [sh.syncs for sh in self.shared],
                 "sync_interval_s": self.gplan.sync_interval,
                 "sync_delay_s": self.gplan.sync_delay}
                if self.shared else {}
            ),
        )

    def _fleet(self, views: list[Snapshot]) -> dict[str, object]:
        failures: Counter[str] = Counter()
        retries: Counter[str] = Counter()
        ejections: Counter[str] = Counter()
        for view in views:  # summed over the gateway instances
            for _cls, _rep, reason, count in view.attempt_failures:
                failures[reason] += count
            for _cls, _rep, reason, count in view.retries:
                retries[reason] += count
            for r in view.replicas:
                ejections[r.name] += r.ejections
        reps: list[dict[str, object]] = []
        for p in self.plans:
            ms = [e.metrics() for e in self.reps[p.name].engines()]
            reps.append(
                {
                    "name": p.name,
                    "profile": p.profile.name,
                    "gpu": p.profile.gpu,
                    "window": PASSTHROUGH_WINDOW if self.passthrough else p.window,
                    "pausable": p.pausable,
                    "window_mode": None if self.passthrough else p.window_mode,
                    "ejections": ejections.get(p.name, 0),
                    "steps": sum(m.steps_total for m in ms),
                    "busy_s": math.fsum(m.busy_s_total for m in ms),
                    "kv_evictions": sum(m.preemptions_total for m in ms),
                    "generated_tokens": sum(m.generation_tokens_total for m in ms),
                }
            )
        return {
            "replicas": reps,
            "attempt_failures": dict(sorted(failures.items())),
            "retries": dict(sorted(retries.items())),
            "faults": self.faults_done,
        }


def run_policy(setup: SimSetup, policy: str, progress: ProgressFn | None = None) -> RunResult:
    """Simulate ``setup``'s workload under one policy (see ``SIM_POLICIES``)."""
    return _Run(setup, policy).run(progress)


def saturation_throughput(
    profile: EngineProfile,
    window: int,
    lengths: Sequence[tuple[int, int]],
    max_tokens: int,
) -> float:
    """Requests per second one engine completes when ``window`` requests are always in flight
    (a closed loop: each finish is replaced at once), for the given (prompt, output) mix.

    This is the capacity that "load" is relative to: offered load 1.0 means arrivals at the rate
    of this saturated throughput. Measured after the first quarter of the completions (warm-up)."""
    if not lengths:
        raise ValueError("no lengths to measure capacity with")
    eng = SimEngine(profile, "fcfs")
    it = 0
    now = 0.0

    def add() -> None:
        nonlocal it
        p, o = lengths[it % len(lengths)]
        p = min(p, profile.kv_capacity_tokens // 2)
        o = max(1, min(o, profile.kv_capacity_tokens - p))
        eng.add(SeqSpec(f"c{it}", p, max(o, max_tokens), target_output_tokens=o))
        it += 1

    for _ in range(min(window, len(lengths))):
        add()
    finishes: list[float] = []
    total = max(len(lengths), 4)
    while len(finishes) < total and eng.has_work():
        adv = eng.advance(INF, now)
        now = adv.now
        for t, e in adv.events:
            if isinstance(e, FinishEvent):
                finishes.append(t)
                add()
        if adv.steps == 0:
            break
    k0 = len(finishes) // 4
    if len(finishes) - k0 < 2 or finishes[-1] <= finishes[k0]:
        raise ValueError("capacity measurement did not reach a steady state")
    return (len(finishes) - 1 - k0) / (finishes[-1] - finishes[k0])
