"""Evict and resume on an engine that cannot pause (an upstream): a stream of a class with
``resume`` gives its slot to a strictly more urgent request and continues later from the tokens
it delivered, within the bounds (a minimum run between evictions, a cap per request); a stream
whose replica fails mid-stream continues on another while it has moves left."""

from __future__ import annotations

from typing import Any

from qosgate.config import default_config
from qosgate.core import AttemptFailed, Dispatch, Preempt, ReplicaSpec, Scheduler, State
from qosgate.core.request import Request
from tests.support.scheduler import Harness


def make(replicas: int = 1, resumes: bool = True, **cfg: Any) -> Harness:
    return Harness(Scheduler(default_config(**cfg), "qos", [
        ReplicaSpec(f"r{i}", 1, resumes=resumes) for i in range(replicas)]))


def running_offline(h: Harness, at: float = 3.0) -> Request:
    """An offline stream that can continue elsewhere, streaming by ``at``."""
    off = h.submit("offline", output=1000)
    off.resumable = True  # (the I/O layer says so from its body)
    h.run_until(at)
    assert off.state is State.RUNNING
    return off


def test_a_resumable_stream_gives_its_slot_to_realtime_and_continues() -> None:
    h = make()
    off = running_offline(h)
    rt = h.submit("realtime")
    assert off.state is State.QUEUED and off.evictions == 1
    assert rt.state is State.DISPATCHED
    assert h.sched.evictions["offline"] == 1
    h.run_until(4.0)
    assert rt.state is State.COMPLETED
    # it goes on without a new first byte: a continuation, counted as one
    resumed = [d for d in h.dispatches if d.req is off]
    assert len(resumed) == 2 and resumed[1].resume and off.state is State.RUNNING
    assert h.sched.resumes["offline"] == 1
    snap = h.sched.snapshot(h.now)
    assert snap.evictions == (("offline", 1),) and snap.resumes == (("offline", 1),)


def test_a_stream_just_resumed_runs_a_while_before_another_eviction() -> None:
    h = make(preemption={"min_run_s": 2.0})
    off = running_offline(h)
    h.submit("realtime")
    h.run_until(3.7)  # realtime done (prefill, 50 tokens) and the stream resumed
    assert off.state is State.RUNNING and off.evictions == 1
    resumed_at = off.ran_since
    rt = h.submit("realtime")
    assert rt.state is State.QUEUED and off.state is State.RUNNING  # too soon
    h.run_until(resumed_at + 1.9)
    assert rt.state is State.QUEUED
    # its minimum run done, the stream gives the waiting realtime request its slot
    h.run_until(resumed_at + 2.0)
    assert off.evictions == 2 and rt.state is State.DISPATCHED


def test_a_request_is_evicted_at_most_max_evictions_times() -> None:
    h = make(preemption={"min_run_s": 0.0, "max_evictions": 1})
    off = running_offline(h)
    h.submit("realtime")
    h.run_until(5.0)
    assert off.state is State.RUNNING and off.evictions == 1
    rt = h.submit("realtime")
    assert rt.state is State.QUEUED and off.state is State.RUNNING


def test_without_resume_or_an_exact_continuation_a_stream_is_never_evicted() -> None:
    h = make()
    off = h.submit("offline", output=1000)  # its body would not continue exactly
    h.run_until(3.0)
    rt = h.submit("realtime")
    assert rt.state is State.QUEUED and off.state is State.RUNNING
    classes = [c.model_copy(update={"resume": False}) if c.name == "offline" else c
               for c in default_config().classes]
    h = make(classes=classes)
    off = running_offline(h)
    rt = h.submit("realtime")
    assert rt.state is State.QUEUED and off.state is State.RUNNING


def test_an_engine_that_cannot_continue_from_ids_keeps_its_streams() -> None:
    h = make(resumes=False)
    off = running_offline(h)
    rt = h.submit("realtime")
    assert rt.state is State.QUEUED and off.state is State.RUNNING


def test_only_a_class_that_may_preempt_evicts() -> None:
    h = make()
    off = running_offline(h)
    api = h.submit("api")
    assert api.state is State.QUEUED and off.state is State.RUNNING


def test_a_stream_whose_replica_breaks_continues_on_another() -> None:
    h = make(replicas=2)
    off = running_offline(h)
    broke_on = off.replica
    decisions = h.sched.stream_broke(off.id, h.now, AttemptFailed("upstream_disconnected"))
    h.inflight.discard(off.id)
    h.apply(decisions)
    again = [d for d in decisions if isinstance(d, Dispatch) and d.req is off]
    assert again and again[0].resume and again[0].replica != broke_on
    assert off.state is State.RUNNING and off.moves == 1
    assert h.sched.moves[("offline", "upstream_disconnected")] == 1
    assert off.avoid is None  # it has its replica: no longer a retry


def test_a_stream_out_of_moves_ends_failed() -> None:
    h = make(replicas=2, fleet={"retries": {"max_moves": 0}})
    off = running_offline(h)
    decisions = h.sched.stream_broke(off.id, h.now, AttemptFailed("upstream_disconnected"))
    h.inflight.discard(off.id)
    h.apply(decisions)
    assert off.state is State.FAILED and off.reason == "upstream_disconnected"


def test_a_stream_found_unresumable_is_no_longer_a_victim() -> None:
    h = make()
    off = running_offline(h)
    h.sched.unresumable(off.id)
    rt = h.submit("realtime")
    assert rt.state is State.QUEUED and off.state is State.RUNNING
    assert not [d for d in h.dispatches if isinstance(d, Preempt)]
