"""The virtual-time driver: one ``Scheduler`` (the core the gateway runs) in front of one or more
``SimEngine`` replicas (the engine model the gateway's in-process engine runs), fed a workload.

Nothing here decides who runs: arrivals go to ``Scheduler.submit``, scheduler timers to ``tick``,
engine first tokens and finishes to ``first_token``/``complete``, what a health probe finds to
``observe``, and a replica's failures to ``attempt_failed``/``fail``, as the gateway's driver and
upstream client hand them over; the driver only carries out the core's decisions on the engines
(``Dispatch`` -> ``add``/``resume``, ``Preempt`` -> ``pause`` or ``abort``) and records each
``Finished`` request.

Time. Events are handled in time order: the next external event (arrival, scheduler timer,
sampling instant, health probe, fault, shared-state sync; typed records on one heap, ``events.py``,
whose order at one instant is fixed by kind) bounds how far each engine may run
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

- Each replica's window (the core's ``ReplicaSpec.max_window``) is given by the scenario (``auto``:
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
  (smaller first, with its priority preemption). ``engine-fcfs`` is the same pass-through in
  front of an FCFS engine: a raw engine with no gateway, as ``qosgate replay`` measures one.

Health and faults (a fleet that fails). Every ``probe_interval`` the driver probes every replica,
as the gateway's driver does, and hands the core what it found: ``observe(up=..., signals=...)``
with the engine's own load figures (running, waiting, KV use, preemptions; what a scrape of
vLLM's ``/metrics`` gives). A scenario's faults act on the simulated engines only; the core
learns of them by the same facts the gateway's upstream client reports:

- ``die`` at t: the engine process is gone, with everything in it. A request on it that had
  streamed to its client fails (``fail(..., "upstream_disconnected")``, charged what it streamed);
  one that had not is ``attempt_failed(..., AttemptFailed("upstream_disconnected"))``, and the
  core retries it elsewhere within its retry budget -- as the upstream client reports a
  connection that breaks after the request went out. A request dispatched to a dead replica is
  refused at once: ``attempt_failed(..., AttemptFailed("upstream_unreachable",
  unreachable=True))`` (a refused connect). A request paused on it when it died lost its state:
  the core holds paused requests in its queue, so it is told when it resumes it (a stream that
  had started fails, one that had not is retried).
  Until ``until_s`` the probes find it down; from then on the replica is up again, empty, and the
  next probe tells the core.
- ``slow`` from t (until ``until_s``): every engine step that starts then takes ``factor`` times
  as long (each time coefficient of the engine profile multiplied).

Layout: ``setup.py`` (what a run is made of), ``gateways.py`` (the instances, routing, shared-state
syncs), ``replica.py`` (a replica's state here), ``events.py`` (the heap), ``results.py`` (what a
run returns). This module is the loop and the handlers that carry facts and decisions between
the core and the engines; it stays over 500 lines because those handlers share one state (the
replicas, the records, the clock) and split apart they would pass it all around.
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

from qosgate.core import (
    AttemptFailed,
    Decision,
    Dispatch,
    Finished,
    Preempt,
    Request,
    Scheduler,
    State,
)
from qosgate.core.batches_feed import SWEEP_S
from qosgate.core.signals import LoadSignals
from qosgate.core.snapshot import Snapshot
from qosgate.models.step import EvictEvent, FinishEvent, SeqSpec, TokenEvent
from qosgate.sim.batches import retry_rule
from qosgate.sim.batches_feed import SimBatches
from qosgate.sim.events import (
    TIMER_RANK,
    ArrivalDue,
    ArrivalsEnd,
    Event,
    EventHeap,
    FaultDue,
    JobDue,
    ProbeDue,
    RetryDue,
    SampleDue,
    SyncDue,
)
from qosgate.sim.gateways import Gateways
from qosgate.sim.replica import SimReplica
from qosgate.sim.results import RequestRecord, RunResult, Sample
from qosgate.sim.setup import (
    PASSTHROUGH_WINDOW,
    SimSetup,
    passthrough_config,
    policy_setup,
)
from qosgate.sim.workload import Arrival

INF = math.inf
DISCONNECTED = "upstream_disconnected"  # the upstream client's reason for a broken connection
UNREACHABLE = "upstream_unreachable"  # ... and for a refused connect
LOST = AttemptFailed(DISCONNECTED)  # a broken call that had sent the client nothing
REFUSED = AttemptFailed(UNREACHABLE, unreachable=True)  # a refused connect

ProgressFn = Callable[[float, int], None]
# (class, tenant) -> (prefill seconds, decode seconds) of engine time
TenantTime = dict[tuple[str, str], tuple[float, float]]


class Simulation:
    """One policy's run of a ``SimSetup``: the gateways' schedulers, the simulated replicas, and
    the event loop between them."""

    def __init__(self, setup: SimSetup, policy: str, progress: ProgressFn | None = None) -> None:
        ps = policy_setup(policy, setup.engine_queue)
        self.setup = setup
        self.policy = policy
        self.progress = progress
        self.plans = setup.plans()
        self.passthrough = ps.passthrough
        cfg = passthrough_config(setup.cfg) if ps.passthrough else setup.cfg
        self.now = 0.0  # the global virtual clock (the shared store's clock)
        # one Scheduler per gateway instance: its own queue, replica objects and windows
        self.gateways = Gateways(cfg, ps, self.plans, setup.gateways, setup.workload,
                                 dict(setup.model_profiles))
        self.sched = self.gateways.schedulers[0]
        self.evictions = [0] * len(self.gateways.schedulers)
        self.events = EventHeap()
        for g in range(len(self.gateways.shared)):  # then one sync every interval
            self.events.push(setup.gateways.sync_interval, SyncDue(g), (g,))
        # engine time is kept (and reported) when the run has models
        self.timed = timed = (bool(setup.model_profiles)
                              or any(st.model for st in setup.workload.streams))
        self.reps = {p.name: SimReplica(p.name, p.profile, ps.engine_queue, setup.engine_preempts,
                                        dict(p.model_profiles), timed)
                     for p in self.plans}
        self.rep_list = list(self.reps.values())
        self.plan_window = {p.name: p.window for p in self.plans}
        self.arr: dict[str, Arrival] = {a.rid: a for a in setup.workload.arrivals}
        self.retry_arrivals: list[Arrival] = []  # attempts of refused requests
        self.retries_due = 0  # ... of which not sent yet
        self.attempt_of: dict[str, tuple[str, int]] = {}  # retry -> (first request, attempt)
        self.records: dict[str, RequestRecord] = {}
        self.samples: list[Sample] = []
        self.arrivals_end = setup.workload.duration
        self.arrivals_end_due = True  # its snapshot is not taken yet
        self.snapshot: dict[str, tuple[bool, int]] | None = None
        self.engine_window: dict[str, float] = {}
        # engine time: each dispatched request's (class, tenant), and the tenants' engine time
        # at the first sample after the warm-up and at the end of the arrival span
        self.charged: dict[str, tuple[str, str]] = {}
        self.time_at_warmup: TenantTime | None = None
        self.time_at_end: TenantTime | None = None
        self.started: set[str] = set()  # requests whose first token went to the client
        self.last_rep: dict[str, str] = {}
        self.late_finishes = 0
        self.pauses = 0
        self.aborts = 0
        self.evicted = 0
        self.moved = 0
        self.resent = 0
        # tokens a stream delivered on engine calls before its current one (evicted, or moved
        # off a replica that died): its continuation's prompt carries them
        self.done_before: dict[str, int] = {}
        self.calls = 0
        self.last_finish = 0.0
        self.sent = 0  # requests submitted so far, first attempts and retries
        self.next_arrival = 0  # index of the next first attempt in the workload
        self.next_sample = 0.0
        self.next_probe = 0.0
        # fault instants in time order: (t, order, action, replica, factor)
        faults: list[tuple[float, int, str, str, float]] = []
        for k, f in enumerate(setup.faults):
            if f.replica not in self.reps:
                raise ValueError(f"fault on unknown replica {f.replica!r}")
            if f.kind == "die":
                faults.append((f.at, k, "die", f.replica, 1.0))
                if f.until is not None:
                    faults.append((f.until, k, "revive", f.replica, 1.0))
            else:
                faults.append((f.at, k, "slow", f.replica, f.factor))
                if f.until is not None:
                    faults.append((f.until, k, "slow", f.replica, 1.0))
        faults.sort()
        for order, (t, _, action, name, factor) in enumerate(faults):
            self.events.push(t, FaultDue(action, name, factor), (order,))
        self.faults_left = len(faults)
        self.faults_done: list[dict[str, object]] = []
        self.events.push(self.arrivals_end, ArrivalsEnd())
        self.events.push(0.0, SampleDue())
        self.events.push(0.0, ProbeDue())
        self._push_next_arrival()
        self._handlers: dict[type[Event], Callable[[Event, float], None]] = {
            ArrivalsEnd: self._on_arrivals_end,
            SampleDue: self._on_sample,
            ProbeDue: self._on_probe,
            FaultDue: self._on_fault,  # type: ignore[dict-item]
            ArrivalDue: self._on_arrival,  # type: ignore[dict-item]
            RetryDue: self._on_retry,  # type: ignore[dict-item]
            SyncDue: self._on_sync,  # type: ignore[dict-item]
            JobDue: self._on_job,  # type: ignore[dict-item]
        }
        # batch jobs beside the workload: fed into gateway 0's scheduler (the instance that
        # owns them), as the gateway's feeder does (``batches_feed.py``)
        self.jobs: SimBatches | None = None
        self.job_events = 0  # job instants on the heap
        self.feed_due = False  # a feed instant is on the heap
        if setup.jobs:
            self.jobs = SimBatches(setup.jobs, setup.batches, retry_rule(setup.batches), setup.seed)
            for k, jp in enumerate(setup.jobs):
                self._push_job(jp.at, JobDue(k, "open"))
                self._push_job(jp.deadline, JobDue(k, "expire"))

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

    def _holder(self, rid: str) -> Scheduler:
        """The gateway instance (its scheduler) that holds ``rid``."""
        return self.gateways.of_request(rid)

    def _touch(self, rep: SimReplica, now: float) -> None:
        if rep.clock < now:  # idle or stuck: a busy engine's clock is never behind ``now``
            rep.clock = now
        rep.stuck = False

    def _call_lost(self, rid: str, now: float, had_streamed: bool, tokens: int) -> list[Decision]:
        """The engine call of ``rid`` broke (its replica died): a stream that had started fails,
        charged what it streamed; an attempt that had sent nothing the core may retry."""
        self.calls += 1
        if had_streamed:  # it may continue on another replica from what it delivered
            sched = self._holder(rid)
            done = self.done_before.get(rid, 0) + tokens
            self.done_before[rid] = done
            sched.progress(rid, done)
            req = sched.requests.get(rid)
            moves = 0 if req is None else req.moves
            out = sched.stream_broke(rid, now, AttemptFailed(DISCONNECTED))
            if req is not None and req.moves > moves:
                self.moved += 1
            return out
        return self._holder(rid).attempt_failed(rid, now, LOST)

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
                return self._holder(rid).fail(rid, now, UNREACHABLE)
            return self._holder(rid).attempt_failed(rid, now, REFUSED)
        self._touch(rep, now)
        if d.resume and rid not in rep.seqs and rid in self.done_before:
            return self._continue(d, rep, now)
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
                    out += self._holder(rid).first_token(rid, now)
                else:
                    fin = e
            if fin is None:
                rep.engine.resume(rid)
            else:
                self.calls += 1
                out += self._holder(rid).complete(
                    rid, now, fin.completion_tokens, cached_tokens=fin.cached_tokens or None
                )
            return out
        a = self.arr[rid]
        return self._add(d, rep, now, a.prompt, a.max_tokens, a.output)

    def _continue(self, d: Dispatch, rep: SimReplica, now: float) -> list[Decision]:
        """A stream evicted or moved goes on here, as the gateway continues it: a sequence
        whose prompt is the request's and the tokens it delivered (the engine computes again
        what its prefix cache lost of it), for the rest of its output."""
        rid = d.req.id
        a = self.arr[rid]
        done = self.done_before[rid]
        prompt = a.prompt + done
        self.resent += prompt
        self._holder(rid).continued(rid, prompt, None)
        return self._add(d, rep, now, prompt,
                         None if a.max_tokens is None else max(1, a.max_tokens - done),
                         max(1, a.output - done))

    def _add(self, d: Dispatch, rep: SimReplica, now: float, prompt: int,
             max_tokens: int | None, output: int) -> list[Decision]:
        """Add the dispatched request's sequence to ``rep``'s engine (a 400 if it cannot fit)."""
        rid = d.req.id
        spec = SeqSpec(
            rid,
            prompt,
            max_tokens,
            target_output_tokens=output,
            # engine-priority: the client's own priority (its class's level), as a client
            # talking to vLLM directly would send it; else qosgate's order (``engine_order``)
            engine_priority=d.req.level if self.passthrough or d.req.order is None
            else d.req.order,
            prefix=self.arr[rid].prefix,
            model=d.req.model,
        )
        if self.timed:  # (only a timed engine says whose its time was)
            self.charged[rid] = (d.req.service_class, d.req.tenant)
        try:
            rep.engine.add(spec)
        except ValueError:
            self.calls += 1
            return self._holder(rid).fail(rid, now, "engine_rejected")
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
        else:  # dropped from the engine: re-dispatched later (a stream continues from there)
            if rid in self.started:
                self.evicted += 1
                self.done_before[rid] = self.done_before.get(rid, 0) + rep.generated(rid)
            else:
                self.aborts += 1
            rep.engine.abort(rid)
            rep.drop(rid)
            rep.forget(rid)

    def _finished(self, d: Finished, now: float) -> None:
        req = d.req
        rid = req.id
        a = self.arr[rid]
        out = req.output_tokens
        self.done_before.pop(rid, None)
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
        if self.jobs is not None and rid in self.jobs.owner:
            self._line_ended(req, out, now)
            return
        if now <= self.arrivals_end or self.snapshot is None:
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
            gateway=self.gateways.of.get(rid, 0),
            retry_of=retry_of,
            attempt=attempt,
            retry_after=req.retry_after if req.state is State.REJECTED else None,
        )
        if now > self.last_finish:
            self.last_finish = now
        if req.state is State.REJECTED and req.retry_after is not None:
            self._retry_later(a, now + req.retry_after)

    def _line_ended(self, req: Request, out: int, now: float) -> None:
        """A job line's attempt ended: the feeder records it, and looks for room a moment
        later (as the gateway's feeder, woken by a line's end)."""
        assert self.jobs is not None
        rid = req.id
        self.started.discard(rid)
        self.last_rep.pop(rid, None)
        k, line = self.jobs.owner[rid]
        again = self.jobs.ended(rid, req.state.value, req.service_class, req.retry_after, out,
                                now)
        if again is not None:
            self._push_job(again, JobDue(k, "line", line))
        if not self.feed_due:
            self.feed_due = True
            self._push_job(now, JobDue(-1, "feed"))

    def _push_job(self, t: float, ev: JobDue) -> None:
        self.job_events += 1
        self.events.push(t, ev, (ev.job, ev.line))

    def _on_job(self, ev: JobDue, now: float) -> None:
        assert self.jobs is not None
        self.job_events -= 1
        if ev.action == "open":
            self.jobs.open(ev.job, now)
        elif ev.action == "line":
            self.jobs.due(ev.job, ev.line)
        elif ev.action == "expire":
            sched = self.gateways.schedulers[0]
            for rid in self.jobs.expire(ev.job, now):
                self.calls += 1
                self.apply(sched.cancel(rid, now, "batch_expired"), now)
            return
        else:
            self.feed_due = False
        self._feed(now)

    def _feed(self, now: float) -> None:
        """Submit the lines the feed policy lets in now; its bound counts the windows of the
        replicas that are up (under engine-priority, whose windows hold everything, each
        replica's own window)."""
        assert self.jobs is not None
        sched = self.gateways.schedulers[0]
        capacity = sum(min(r.window, self.plan_window[r.name])
                       for r in sched.snapshot(now).replicas if r.up)
        plans = self.jobs.plans
        for k, _line, rid in self.jobs.take(capacity, len(sched.requests), now):
            jp = plans[k]
            prompt, output = jp.lines[_line]
            a = Arrival(now, rid, -1, prompt, output, max(output, jp.max_tokens))
            self.arr[rid] = a
            self.gateways.of[rid] = 0
            self.calls += 2
            req = sched.make_request(rid, jp.inputs, now, prompt, a.max_tokens)
            self.apply(sched.submit(req, now), now)
        if not self.feed_due and self.jobs.waiting_for_room():
            self.feed_due = True
            self._push_job(now + SWEEP_S, JobDue(-1, "feed"))

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
        self.retries_due += 1
        self.events.push(t, RetryDue(again))

    # ------------------------------------------------------------------ engines -> scheduler
    def _deliver(self, rep: SimReplica) -> None:
        t = rep.clock
        self.now = t
        while rep.buf:
            ev = rep.buf.pop(0)
            self.calls += 1
            sched = self._holder(ev.seq_id)
            if isinstance(ev, TokenEvent):
                self.started.add(ev.seq_id)
                self.apply(sched.first_token(ev.seq_id, t), t)
            else:
                before = self.done_before.pop(ev.seq_id, 0)
                self.apply(sched.complete(
                    ev.seq_id, t, before + ev.completion_tokens,
                    # (a continuation's cache counts its own prompt, not the request's)
                    cached_tokens=None if before else ev.cached_tokens or None,
                ), t)
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
                    model_time=m.model_time or None,
                )
            rep.told_up = rep.alive
            for sched in self.gateways.schedulers:
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
            rep.slow(factor)
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
        rep.engine = rep.new_engine()
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
        self.time_at_end = self._tenant_time()

    def _tenant_time(self) -> TenantTime:
        """Every (class, tenant)'s engine time so far: its requests' share of every step of
        every engine (``SimEngine.engine_time``), (prefill seconds, decode seconds)."""
        out: TenantTime = {}
        for rep in self.rep_list:
            for eng in rep.engines():
                for rid, (prefill, decode) in eng.engine_time().items():
                    key = self.charged[rid]
                    p, d = out.get(key, (0.0, 0.0))
                    out[key] = (p + prefill, d + decode)
        return out

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
        views = [s.snapshot(t) for s in self.gateways.schedulers]
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
    def live(self) -> bool:
        """Arrivals to come, or requests without an outcome (once not, for good)."""
        return (self.next_arrival < len(self.setup.workload.arrivals) or self.retries_due > 0
                or len(self.records) < self.sent
                or (self.jobs is not None and self.jobs.live()))

    def run(self) -> RunResult:
        gws = self.gateways.schedulers
        events = self.events
        reps = self.rep_list
        records = self.records
        arrivals = self.setup.workload.arrivals
        now = 0.0
        while True:
            t_tmr = INF
            g_tmr = 0
            for g, s in enumerate(gws):
                nt = s.next_timer()
                if nt is not None and nt < t_tmr:
                    t_tmr, g_tmr = nt, g
            live = self.live()
            t_next, rank = events.first(live)
            t_ext = min(t_next, t_tmr)
            best, best_t = self._advance_engines(t_ext)
            if best is not None and best_t <= t_ext:  # an engine's event goes first
                now = best_t
                self._deliver(best)
                continue
            if t_ext == INF:
                break
            if not live and t_tmr == INF:
                break  # only sampling/probe/snapshot instants are left and nothing lives
            if (
                self.next_arrival >= len(arrivals)
                and not self.retries_due
                and t_tmr == INF
                and not self.arrivals_end_due
                and not self.faults_left
                and not self.job_events
                and all(r.buf is None and (r.stuck or not r.engine.has_work()) for r in reps)
                and all(r.alive == r.told_up for r in reps)
            ):
                break  # live requests but nothing can move: a deadlock (reported as unfinished)
            now = t_ext
            self.now = now
            if t_tmr == now and (t_next > now or rank > TIMER_RANK):
                self.calls += 1
                self.apply(gws[g_tmr].tick(now), now)
            else:
                ev = events.pop()
                self._handlers[type(ev)](ev, now)
        if self.arrivals_end_due:  # everything ended before the end of the arrival span
            self._take_snapshot()
        if self.progress is not None:
            self.progress(now, len(records))
        return self._result(self.sent, now)

    def _advance_engines(self, until: float) -> tuple[SimReplica | None, float]:
        """Run every engine up to ``until`` or to its first step with an event for the core;
        the replica whose undelivered events come first (and when)."""
        best: SimReplica | None = None
        best_t = INF
        for rep in self.rep_list:
            if rep.buf is None and not rep.stuck:
                eng = rep.engine
                while rep.clock < until and eng.has_work():
                    adv = eng.advance(until, rep.clock)
                    rep.clock = adv.now
                    if adv.events:
                        evs: list[TokenEvent | FinishEvent] = []
                        for _, e in adv.events:
                            if isinstance(e, EvictEvent):
                                self.evictions[self.gateways.of.get(e.seq_id, 0)] += 1
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
        return best, best_t

    # ------------------------------------------------------------------ external events
    def _on_arrivals_end(self, ev: Event, now: float) -> None:
        self.arrivals_end_due = False
        self._take_snapshot()

    def _on_sample(self, ev: Event, now: float) -> None:
        if self.time_at_warmup is None and now >= self.setup.warmup:
            self.time_at_warmup = self._tenant_time()
        self._sample(now)
        self.next_sample += self.setup.sample_interval
        self.events.push(self.next_sample, SampleDue())
        if self.progress is not None:
            self.progress(now, len(self.records))

    def _on_probe(self, ev: Event, now: float) -> None:
        self._probe(now)
        self.next_probe += self.setup.probe_interval
        self.events.push(self.next_probe, ProbeDue())

    def _on_fault(self, ev: FaultDue, now: float) -> None:
        self.faults_left -= 1
        self._fault(now, ev.action, ev.replica, ev.factor)

    def _push_next_arrival(self) -> None:
        arrivals = self.setup.workload.arrivals
        if self.next_arrival < len(arrivals):
            a = arrivals[self.next_arrival]
            self.events.push(a.t, ArrivalDue(a))

    def _on_arrival(self, ev: ArrivalDue, now: float) -> None:
        self.next_arrival += 1
        self._push_next_arrival()
        self._submit(ev.arrival, now)

    def _on_retry(self, ev: RetryDue, now: float) -> None:
        self.retries_due -= 1
        self._submit(ev.arrival, now)

    def _submit(self, a: Arrival, now: float) -> None:
        self.sent += 1
        self.calls += 2
        g = self.gateways.route(a.stream)
        self.gateways.of[a.rid] = g
        sched = self.gateways.schedulers[g]
        inputs = self.setup.workload.inputs[a.stream]
        req = sched.make_request(a.rid, inputs, now, a.prompt, a.max_tokens, prefix=a.prefix,
                                 model=self.setup.workload.streams[a.stream].model or "")
        req.resumable = True  # a stream with nothing a continuation could not reproduce
        # every attempt of one client's request carries its first attempt's id, so admission
        # can tell a retry from a new request
        req.retry_key = self.attempt_of.get(a.rid, (a.rid, 0))[0]
        self.apply(sched.submit(req, now), now)

    def _on_sync(self, ev: SyncDue, now: float) -> None:
        self.calls += 1
        t, due = self.gateways.sync_step(ev, now)
        self.events.push(t, due, (due.gateway,))

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
        for sched in self.gateways.schedulers:
            for (_cls, _tenant, outcome, _reason), count in sched.outcomes.items():
                ledger[outcome] += count
        jobs = self.jobs
        if jobs is not None:  # the core's ledger less the job lines': the live requests'
            ledger.subtract(jobs.outcomes)
            ledger = Counter({k: v for k, v in ledger.items() if v})
        arrivals = (*self.setup.workload.arrivals, *self.retry_arrivals)
        records = [self.records[a.rid] for a in arrivals if a.rid in self.records]
        views = [s.snapshot(now) for s in self.gateways.schedulers]
        unfinished = sum(v.queued_total + sum(c.inflight for c in v.classes) for v in views)
        return RunResult(
            policy=self.policy,
            classes=tuple(c.name for c in self.sched.classes),
            records=records,
            samples=self.samples,
            arrivals_end=self.arrivals_end,
            makespan=self.last_finish,
            arrivals=n,
            engine={k: float(v) for k, v in sorted(totals.items())},
            engine_window=self.engine_window,
            outcomes=dict(sorted(ledger.items())),
            pauses=self.pauses,
            aborts=self.aborts,
            evictions=self.evicted,
            moves=self.moved,
            resent_tokens=self.resent,
            late_finishes=self.late_finishes,
            unfinished=unfinished,
            scheduler_calls=self.calls,
            fleet=self._fleet(views),
            gateways=len(self.gateways.schedulers),
            gateway_evictions=tuple(self.evictions),
            shared=(
                {"syncs": [sh.syncs for sh in self.gateways.shared],
                 "sync_interval_s": self.setup.gateways.sync_interval,
                 "sync_delay_s": self.setup.gateways.sync_delay}
                if self.gateways.shared else {}
            ),
            prefix_cache=self._prefix_cache(),
            jobs=jobs.records() if jobs is not None else [],
            job_outcomes=dict(sorted(jobs.outcomes.items())) if jobs is not None else {},
            job_attempts=sum(j.submitted for j in jobs.jobs) if jobs is not None else 0,
            engine_time=_by_class(self._tenant_time()),
            engine_time_window=_by_class(_less(self.time_at_end or {},
                                               self.time_at_warmup or {})),
        )

    def _prefix_cache(self) -> dict[str, dict[str, int]]:
        """Per replica, its engines' prefix-cache counters (tokens), when the workload carries
        prefixes (else empty: a run without them reports nothing of a cache)."""
        if not any(a.prefix is not None for a in self.setup.workload.arrivals):
            return {}
        host = any(p.profile.host_kv_tokens for p in self.plans)
        out: dict[str, dict[str, int]] = {}
        for p in self.plans:
            ms = [e.metrics() for e in self.reps[p.name].engines()]
            out[p.name] = {
                "queries": sum(m.prefix_cache_queries_total for m in ms),
                "hits": sum(m.prefix_cache_hits_total for m in ms),
                "prefill_tokens": sum(m.prefill_tokens_total for m in ms),
            }
            if host:  # hits loaded from a host tier (vLLM's external_prefix_cache_hits)
                out[p.name]["host_hits"] = sum(m.external_prefix_cache_hits_total for m in ms)
        return out

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


def _less(end: TenantTime, start: TenantTime) -> TenantTime:
    """The engine time from ``start`` to ``end``."""
    out: TenantTime = {}
    for key, (p, d) in end.items():
        p0, d0 = start.get(key, (0.0, 0.0))
        out[key] = (p - p0, d - d0)
    return out


def _by_class(time: TenantTime) -> dict[str, dict[str, dict[str, float]]]:
    """class -> tenant -> its prefill and decode seconds (``RunResult.engine_time``)."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (cls, tenant), (p, d) in sorted(time.items()):
        out.setdefault(cls, {})[tenant] = {"prefill_s": p, "decode_s": d}
    return out


def run_policy(setup: SimSetup, policy: str, progress: ProgressFn | None = None) -> RunResult:
    """Simulate ``setup``'s workload under one policy (see ``SIM_POLICIES``)."""
    return Simulation(setup, policy, progress).run()
