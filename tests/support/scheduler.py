"""A tiny virtual-time engine for driving the scheduler in tests.

Not a scheduler: it only plays the engine's part (a dispatched request yields its first token after
``prefill_s`` and completes after ``output_tokens * decode_s``), records every decision, and checks
the invariants that must hold after every event.

It also watches the order in which the scheduler's queue hands out requests (``policy.pop``), and
which of them it dispatches and which it puts back (held): no rule may let a request of a lower
non-strict class take a replica that a request of a higher one, popped before it in the same fill
and held, could have been placed on (served its model, not paused elsewhere, not a retry avoiding
it while its model has another replica; a request resuming where it was paused goes past the TPOT
guard and the prefill budget, as documented). That is the policy's order kept against every
rule beside it (the reserve, the prefill budget, the TPOT guard); a rule that held one class and
let a lower one through would show here.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field

from qosgate.core import (
    AttemptFailed,
    Dispatch,
    Finished,
    Preempt,
    QosInputs,
    Request,
    Scheduler,
    State,
)
from qosgate.core.prefix import Prefix


@dataclass
class EngineRun:
    """One dispatch of a request on the harness's engine (a stale one is skipped)."""

    rid: str
    output_tokens: int
    dispatch_gen: int


@dataclass
class Harness:
    sched: Scheduler
    prefill_s: float = 0.05
    decode_s: float = 0.01
    now: float = 0.0
    events: list[tuple[float, int, str, EngineRun]] = field(default_factory=list)
    seq: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    outcomes: dict[str, Request] = field(default_factory=dict)
    inflight: set[str] = field(default_factory=set)
    dispatch_no: Counter[str] = field(default_factory=Counter)
    dispatches: list[Dispatch] = field(default_factory=list)
    output_of: dict[str, int] = field(default_factory=dict)
    ids: int = 0
    # what the scheduler did with its queue since the last check: ("pop"|"restore", req) and
    # ("dispatch", req, replica), in order
    timeline: list[tuple[object, ...]] = field(default_factory=list)

    def __post_init__(self) -> None:
        s = self.sched
        pop, restore, dispatch = s.policy.pop, s.policy.restore, s._dispatch
        timeline = self.timeline

        def watched_pop() -> Request | None:
            req = pop()
            if req is not None:
                timeline.append(("pop", req))
            return req

        def watched_restore(req: Request) -> None:
            timeline.append(("restore", req))
            restore(req)

        def watched_dispatch(req: Request, rep: object, now: float, out: list[object],
                             over: bool = False) -> None:
            timeline.append(("dispatch", req, rep.name,  # type: ignore[attr-defined]
                             req.replica is not None))  # resumes where it was paused
            if over:  # past a full window: only to overtake unstarted work, in an ordered engine
                assert rep.ordered and rep.free == 0  # type: ignore[attr-defined]
                order = s.policy.order(req)
                if req.order is not None:
                    order = min(order, req.order)
                later = [r for r in rep.inflight.values()  # type: ignore[attr-defined]
                         if r.state is State.DISPATCHED and r.order > order]
                excess = len(rep.inflight) - rep.window  # type: ignore[attr-defined]
                assert len(later) > max(0, excess), f"{req.id} overtook nothing on {rep}"
            dispatch(req, rep, now, out, over)  # type: ignore[arg-type]

        s.policy.pop = watched_pop
        s.policy.restore = watched_restore
        s._dispatch = watched_dispatch  # type: ignore[method-assign]

    def submit(
        self,
        qos_class: str | None = None,
        tenant_key: str | None = None,
        prompt: int = 100,
        output: int = 50,
        max_tokens: int | None = None,
        priority: int | None = None,
        model: str = "",
        prefix: Prefix | None = None,
        session: str | None = None,
    ) -> Request:
        self.ids += 1
        rid = f"q{self.ids}"
        req = self.sched.make_request(
            rid,
            QosInputs(api_key=tenant_key, qos_class=qos_class, priority=priority),
            self.now,
            prompt,
            max_tokens or min(output, 4096),
            model,
            prefix=prefix,
            session=session,
        )
        self.output_of[rid] = output
        self.apply(self.sched.submit(req, self.now))
        return req

    def cancel(self, rid: str) -> None:
        self.apply(self.sched.cancel(rid, self.now))

    def fail_attempt(self, rid: str, **kind: object) -> None:
        """The engine call of a dispatched request failed before its first token."""
        self.inflight.discard(rid)  # that call is gone, whatever the core decides
        self.apply(self.sched.attempt_failed(
            rid, self.now, AttemptFailed("upstream_500", **kind)))  # type: ignore[arg-type]

    def _check_order(self) -> None:
        """No lower class went past a held higher one onto a replica that one could use (one
        the router keeps queued for its warm replica, within its bound, aside)."""
        s = self.sched
        router = s.fleet.router
        held: dict[str, Request] = {}  # popped in this fill and neither dispatched nor back
        for ev in self.timeline:
            kind, req = ev[0], ev[1]
            assert isinstance(req, Request)
            if kind == "pop":
                held[req.id] = req
            elif kind == "restore":
                held.pop(req.id, None)
            else:
                held.pop(req.id, None)
                name = ev[2]
                if s.classes[req.class_level].strict:
                    continue
                rep = s.replicas[name]  # type: ignore[index]
                if ev[3] and rep.strict_streams and s.fleet.hold_others:
                    # a paused request may resume where the TPOT guard or the prefill budget
                    # holds the other classes off (docs/guides/fleet.md): its state is there
                    continue
                for h in held.values():
                    if (s.classes[h.class_level].strict or h.class_level >= req.class_level
                            or not rep.serves(h.model) or h.replica not in (None, name)
                            or self._avoids(h, name) or router.holds(h, self.now)):
                        continue
                    raise AssertionError(
                        f"{req.id} ({req.service_class}) went to {name} past {h.id} "
                        f"({h.service_class}), held though it could have gone there")
        self.timeline.clear()

    def apply(self, decisions: list[object]) -> None:
        self._check_order()
        lower_to: set[str] = set()  # replicas a lower band was dispatched to
        for d in decisions:
            if isinstance(d, Dispatch):
                assert d.req.id not in self.inflight, f"{d.req.id} dispatched twice at once"
                assert self.finished[d.req.id] == 0, f"{d.req.id} dispatched after its end"
                self.inflight.add(d.req.id)
                self.dispatches.append(d)
                if not self.sched.classes[d.req.level].strict:
                    lower_to.add(d.replica)
                self.dispatch_no[d.req.id] += 1
                run = EngineRun(d.req.id, self.output_of[d.req.id], self.dispatch_no[d.req.id])
                self._at(self.now + self.prefill_s, "first", run)
                self._at(self.now + self.prefill_s + run.output_tokens * self.decode_s, "done", run)
            elif isinstance(d, Preempt):
                assert d.req.id in self.inflight
                self.inflight.discard(d.req.id)
            elif isinstance(d, Finished):
                self.finished[d.req.id] += 1
                assert self.finished[d.req.id] == 1, f"{d.req.id} ended twice"
                assert d.req.state.terminal
                self.inflight.discard(d.req.id)
                self.outcomes[d.req.id] = d.req
        self.check()
        if lower_to and self.sched.policy.preemptive:
            # ... while a realtime request that replica could have taken waited
            for r in self.sched.requests.values():
                if r.state is not State.QUEUED or not self.sched.classes[r.level].strict:
                    continue
                for name in lower_to:
                    rep = self.sched.replicas[name]
                    could = (rep.serves(r.model) and r.replica in (None, name)
                             and not self._avoids(r, name))
                    assert not could, "a lower band was dispatched while realtime waited"

    def _avoids(self, req: Request, name: str) -> bool:
        """``req`` is a retry that may not go back to replica ``name``, where its last attempt
        failed, while another usable replica serves its model (``Fleet.may_take``): the retry
        goes elsewhere, so what a lower class takes there was never its to take."""
        return req.avoid == name and any(
            rep.name != name and rep.serves(req.model) for rep in self.sched.fleet.usable)

    def _at(self, when: float, kind: str, run: EngineRun) -> None:
        self.seq += 1
        heapq.heappush(self.events, (when, self.seq, kind, run))

    def run_until(self, t: float) -> None:
        while True:
            nxt_timer = self.sched.next_timer()
            nxt_event = self.events[0][0] if self.events else None
            candidates = [x for x in (nxt_timer, nxt_event) if x is not None and x <= t]
            if not candidates:
                break
            self.now = max(self.now, min(candidates))
            if nxt_event is not None and nxt_event <= self.now:
                _, _, kind, run = heapq.heappop(self.events)
                req = self.sched.requests.get(run.rid)
                if req is None or run.dispatch_gen != self.dispatch_no[run.rid]:
                    continue  # preempted, cancelled or ended meanwhile: that engine call is gone
                if run.rid not in self.inflight:
                    continue
                if kind == "first":
                    self.apply(self.sched.first_token(run.rid, self.now))
                else:
                    self.apply(self.sched.complete(run.rid, self.now, run.output_tokens))
            else:
                self.apply(self.sched.tick(self.now))
        self.now = max(self.now, t)
        self.apply(self.sched.tick(self.now))

    def check(self) -> None:
        s = self.sched
        queued = [r for r in s.requests.values() if r.state is State.QUEUED]
        running = [r for r in s.requests.values() if r.state in (State.DISPATCHED, State.RUNNING)]
        assert len(queued) == s.queued_total == len(s.policy) == sum(len(q) for q in s.queued)
        assert s.backlog.paused == sum(1 for r in queued if r.replica is not None)
        assert {r.id for r in running} == self.inflight
        assert all(not r.state.terminal for r in s.requests.values())
        usable = [rep for rep in s.replicas.values() if rep.eligible(self.now)]
        free = sum(rep.free for rep in usable)
        assert free == s.free_slots
        assert sum(len(rep.inflight) for rep in s.replicas.values()) == len(running)
        for r in running:  # never sent to a replica that does not serve its model
            assert s.replicas[r.replica or ""].serves(r.model)
            assert r.order is not None  # what the engine is told to run it in
        # a fair-share tag is held back only while its request waits unstarted in an engine
        for r in s.requests.values():
            assert r.tagged_by is None or r.state is State.DISPATCHED, f"{r.id} holds its tag"
        for r in self.outcomes.values():
            assert r.tagged_by is None, f"{r.id} ended holding its tag"
        # work-conserving: nothing waits while a slot it could use is free -- on a replica
        # that may take it now (up, not ejected or cooling, serving its model, its reserved
        # share and prefill budget allowing; a request paused on an in-process engine can
        # only resume on that replica, where its state lives) -- unless the router keeps it
        # for its warm replica, within its bound (when the scheduler wakes at the latest)
        for r in queued:
            room = sum(rep.free for rep in usable if s.may_take(rep, r, self.now))
            if room and s.fleet.router.holds(r, self.now):
                wake = s.next_timer()
                assert wake is not None and wake <= s.fleet.router.wake_at(self.now)
                continue
            assert room == 0, f"{r.id} waits while a slot it could use is free"
