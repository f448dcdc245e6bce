"""The virtual-time driver: one ``Scheduler`` (the core the gateway runs) in front of one or more
``SimEngine`` replicas (the engine model the gateway's in-process engine runs), fed a workload.

Nothing here decides who runs: arrivals go to ``Scheduler.submit``, scheduler timers to ``tick``,
engine first tokens and finishes to ``first_token``/``complete``; the driver only carries out the
core's decisions on the engines (``Dispatch`` -> ``add``/``resume``, ``Preempt`` -> ``pause`` or
``abort``) and records each ``Finished`` request.

Time. Events are handled in time order: the next external event (arrival, scheduler timer,
sampling instant) bounds how far each engine may run (``SimEngine.advance(until=...)``, the fast
path that computes stretches of pure decode steps in closed form). An engine stops at the end of
the first step that yields a first token or a finish; that step's events are held until the
global clock reaches them, then delivered. Every replica has its own clock (the end of its last
step); work given to a busy replica joins its next step, work given to an idle one starts at once.
Engines are advanced independently between external events. That is exact because an engine's
event only ever frees capacity on its own replica: a request waits in qosgate only while every
window is full, so the slot freed by a finish on replica A goes to A (the core picks the replica
with the most free slots, and a paused request resumes only where it was paused).

Windows and preemption (the choices, and why):

- Each replica's window (the core's ``ReplicaSpec.capacity``) defaults to the engine's
  ``max_num_seqs``, as the gateway's in-process engine does: qosgate holds the queue and orders
  it, while the engine's own waiting queue only holds what is dispatched but not yet admitted
  (prefill budget, KV). A smaller window trades peak throughput for shorter engine steps (lower
  TPOT) and a shorter engine queue; ``window`` in a scenario sets it.
- Replicas are *pausable*, as the gateway's in-process engine declares: the simulated engine pauses
  a sequence at a token boundary and resumes it with its KV intact. So the core's ``Preempt`` is a
  pause for a request that already streams (``pause=True``) and an abort + later re-dispatch for
  one that has not produced its first token (``pause=False``: the prefill is lost, nothing reached
  the client). A pausable replica is what the engine model supports and lets a realtime request
  make room even when every slot holds a decoding batch job; a non-pausable one could only pull
  back requests still in prefill.
- ``engine-priority`` ("engine priority alone"): qosgate passes everything straight through
  (``fifo``, a window of 2**30, so nothing ever queues in qosgate) and the engine's own
  vLLM-priority queue orders by the request's level (smaller first, with its priority preemption).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
from qosgate.engines.simmodel import EngineProfile, SimEngine
from qosgate.engines.step import EvictEvent, FinishEvent, SeqSpec, TokenEvent
from qosgate.sim.workload import Arrival, Workload

PASSTHROUGH_WINDOW = 1 << 30
SIM_POLICIES: tuple[str, ...] = (*POLICY_NAMES, "engine-priority")
INF = math.inf


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
    anywhere: the baseline) and vLLM-priority under the class-aware policies, which forward the
    request's level as the engine priority (as the gateway does); ``engine-priority`` always uses
    the engine's priority queue."""
    if name == "engine-priority":
        return PolicySetup(name, "fifo", "priority", True)
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(SIM_POLICIES)}")
    if engine_queue == "auto":
        return PolicySetup(name, name, "fcfs" if name == "fifo" else "priority", False)
    return PolicySetup(name, name, engine_queue, False)


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


@dataclass(slots=True, frozen=True)
class Sample:
    t: float
    queued: tuple[int, ...]  # qosgate queue per class level
    inflight: int  # dispatched/running per qosgate
    engine_running: int
    engine_waiting: int
    engine_paused: int
    kv_usage: float  # mean over replicas


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


@dataclass(slots=True, frozen=True)
class SimSetup:
    cfg: QosConfig
    profile: EngineProfile
    replicas: int
    window: int
    workload: Workload
    sample_interval: float
    engine_queue: EngineQueue = "auto"


class _Rep:
    __slots__ = ("buf", "clock", "engine", "name", "parked", "stuck")

    def __init__(self, name: str, engine: SimEngine) -> None:
        self.name = name
        self.engine = engine
        self.clock = 0.0  # end of the engine's last step
        self.buf: list[TokenEvent | FinishEvent] | None = None  # events at ``clock``, undelivered
        self.stuck = False  # has work but cannot step until something changes
        # events of the step under way when qosgate paused the sequence: delivered on resume
        self.parked: dict[str, list[TokenEvent | FinishEvent]] = {}

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


ProgressFn = Callable[[float, int], None]


class _Run:
    def __init__(self, setup: SimSetup, policy: str) -> None:
        ps = policy_setup(policy, setup.engine_queue)
        self.setup = setup
        self.policy = policy
        window = PASSTHROUGH_WINDOW if ps.passthrough else setup.window
        specs = [ReplicaSpec(f"r{i}", window, pausable=True) for i in range(setup.replicas)]
        self.sched = Scheduler(setup.cfg, ps.core_policy, specs)
        self.reps = {s.name: _Rep(s.name, SimEngine(setup.profile, ps.engine_queue)) for s in specs}
        self.rep_list = list(self.reps.values())
        self.arr: dict[str, Arrival] = {a.rid: a for a in setup.workload.arrivals}
        self.records: dict[str, RequestRecord] = {}
        self.samples: list[Sample] = []
        self.window_end = setup.workload.duration
        self.snapshot: dict[str, tuple[bool, int]] | None = None
        self.engine_window: dict[str, float] = {}
        self.late_finishes = 0
        self.pauses = 0
        self.aborts = 0
        self.calls = 0
        self.last_finish = 0.0

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

    def _dispatch(self, d: Dispatch, now: float) -> list[Decision]:
        rep = self.reps[d.replica]
        rid = d.req.id
        self._touch(rep, now)
        if d.resume:
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
                    out += self.sched.first_token(rid, now)
                else:
                    fin = e
            if fin is None:
                rep.engine.resume(rid)
            else:
                self.calls += 1
                out += self.sched.complete(rid, now, fin.completion_tokens)
            return out
        a = self.arr[rid]
        spec = SeqSpec(
            rid,
            a.prompt,
            a.max_tokens,
            target_output_tokens=a.output,
            engine_priority=d.req.level,
        )
        try:
            rep.engine.add(spec)
        except ValueError:
            self.calls += 1
            return self.sched.fail(rid, now, "engine_rejected")
        return []

    def _preempt(self, d: Preempt, now: float) -> None:
        rep = self.reps[d.replica]
        rid = d.req.id
        self._touch(rep, now)
        if d.pause:
            self.pauses += 1
            under_way = rep.take(rid)
            if under_way:  # its step is already under way: what it produced waits for resume
                rep.parked[rid] = under_way
            if not any(isinstance(e, FinishEvent) for e in under_way):
                rep.engine.pause(rid)
        else:  # no first token yet: drop it from the engine, it is re-dispatched later
            self.aborts += 1
            rep.engine.abort(rid)
            rep.drop(rid)

    def _finished(self, d: Finished, now: float) -> None:
        req = d.req
        rid = req.id
        a = self.arr[rid]
        out = req.output_tokens
        if req.state is not State.COMPLETED and req.replica is not None:
            rep = self.reps.get(req.replica)
            if rep is not None:  # e.g. timed out while paused: free its KV in the engine
                fin = rep.finish_of(rid)
                if fin is not None:
                    out = fin.completion_tokens
                else:
                    with contextlib.suppress(KeyError):
                        out = rep.engine.generated(rid)
                rep.engine.abort(rid)
                rep.drop(rid)
        if now <= self.window_end or self.snapshot is None:
            win = (req.first_token_at is not None, out)
        else:
            win = self.snapshot.get(rid, (False, 0))
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
        )
        if now > self.last_finish:
            self.last_finish = now

    # ------------------------------------------------------------------ engines -> scheduler
    def _deliver(self, rep: _Rep) -> None:
        t = rep.clock
        sched = self.sched
        while rep.buf:
            ev = rep.buf.pop(0)
            self.calls += 1
            if isinstance(ev, TokenEvent):
                self.apply(sched.first_token(ev.seq_id, t), t)
            else:
                self.apply(sched.complete(ev.seq_id, t, ev.completion_tokens), t)
        rep.buf = None

    def _take_snapshot(self) -> None:
        snap: dict[str, tuple[bool, int]] = {}
        for rid, req in self.sched.requests.items():
            gen = 0
            rep = self.reps.get(req.replica) if req.replica is not None else None
            if rep is not None:
                try:
                    gen = rep.engine.generated(rid)
                except KeyError:
                    fin = rep.finish_of(rid)
                    gen = fin.completion_tokens if fin is not None else 0
            snap[rid] = (req.first_token_at is not None or gen > 0, gen)
        self.snapshot = snap
        self.engine_window = {
            "generated_tokens": float(
                sum(r.engine.metrics().generation_tokens_total for r in self.rep_list)
            ),
            "busy_s": sum(r.engine.metrics().busy_s_total for r in self.rep_list),
        }

    def _sample(self, t: float) -> None:
        running = waiting = paused = 0
        kv = 0.0
        for rep in self.rep_list:
            m = rep.engine.metrics()
            running += m.num_running
            waiting += m.num_waiting
            paused += m.num_paused
            kv += m.kv_usage
        sched = self.sched
        inflight = sum(len(r.inflight) for r in sched.replicas.values())
        self.samples.append(
            Sample(
                t,
                tuple(len(q) for q in sched.queued),
                inflight,
                running,
                waiting,
                paused,
                kv / len(self.rep_list),
            )
        )

    # ------------------------------------------------------------------ the event loop
    def run(self, progress: ProgressFn | None = None) -> RunResult:
        sched = self.sched
        arrivals = self.setup.workload.arrivals
        inputs = self.setup.workload.inputs
        n = len(arrivals)
        reps = self.rep_list
        interval = self.setup.sample_interval
        next_sample = 0.0
        win_end = self.window_end
        snap_due = True
        i = 0
        now = 0.0
        while True:
            t_arr = arrivals[i].t if i < n else INF
            nt = sched.next_timer()
            t_tmr = INF if nt is None else nt
            live = i < n or bool(sched.requests)
            t_smp = next_sample if live else INF
            t_win = win_end if snap_due else INF
            t_ext = min(t_arr, t_tmr, t_smp, t_win)
            best: _Rep | None = None
            best_t = INF
            for rep in reps:
                if rep.buf is None and not rep.stuck:
                    eng = rep.engine
                    while rep.clock < t_ext and eng.has_work():
                        adv = eng.advance(t_ext, rep.clock)
                        rep.clock = adv.now
                        if adv.events:
                            evs: list[TokenEvent | FinishEvent] = [
                                e for _, e in adv.events if not isinstance(e, EvictEvent)
                            ]
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
            if i >= n and t_tmr == INF and not sched.requests:
                break  # only sampling/snapshot instants are left and nothing lives
            if (
                i >= n
                and t_tmr == INF
                and t_win == INF
                and all(r.buf is None and (r.stuck or not r.engine.has_work()) for r in reps)
            ):
                break  # live requests but nothing can move: a deadlock (reported as unfinished)
            now = t_ext
            if t_win == now:
                snap_due = False
                self._take_snapshot()
            elif t_smp == now:
                self._sample(now)
                next_sample += interval
                if progress is not None:
                    progress(now, len(self.records))
            elif t_tmr == now:
                self.calls += 1
                self.apply(sched.tick(now), now)
            else:
                a = arrivals[i]
                i += 1
                self.calls += 2
                req = sched.make_request(a.rid, inputs[a.stream], now, a.prompt, a.max_tokens)
                self.apply(sched.submit(req, now), now)
        if snap_due:  # everything ended before the end of the arrival window
            self._take_snapshot()
        if progress is not None:
            progress(now, len(self.records))
        return self._result(n)

    def _result(self, n: int) -> RunResult:
        totals: dict[str, float] = {}
        for rep in self.rep_list:
            m = rep.engine.metrics()
            for key, v in (
                ("steps", m.steps_total),
                ("busy_s", m.busy_s_total),
                ("kv_evictions", m.preemptions_total),
                ("prompt_tokens", m.prompt_tokens_total),
                ("generated_tokens", m.generation_tokens_total),
            ):
                totals[key] = totals.get(key, 0.0) + v
        ledger: Counter[str] = Counter()
        for (_cls, _tenant, outcome, _reason), count in self.sched.outcomes.items():
            ledger[outcome] += count
        arrivals = self.setup.workload.arrivals
        records = [self.records[a.rid] for a in arrivals if a.rid in self.records]
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
            unfinished=len(self.sched.requests),
            scheduler_calls=self.calls,
        )


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
