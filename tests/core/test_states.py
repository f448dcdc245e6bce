"""The request's transition table is a promise about the scheduler, checked both ways.

``Request.move`` refuses any move outside ``TRANSITIONS``, so every move the scheduler makes is
in the table; the table in turn must hold no move the scheduler never makes, or the state
diagram drawn from it (docs/guides/scheduling.md) would show a path no request takes. Each
scripted situation below drives the scheduler into one family of moves; together they must
perform every move in the table.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from qosgate.config import Admission, default_config
from qosgate.core import QosInputs, ReplicaSpec, Request, Scheduler, State
from qosgate.core.request import TERMINAL, TRANSITIONS
from tests.support.classes import with_reserve
from tests.support.scheduler import Harness

Move = tuple[State, State]


def _harness(capacity: int = 1, pausable: bool = False, **cfg: object) -> Harness:
    sched = Scheduler(default_config(**cfg), "qos",
                      [ReplicaSpec("r0", capacity, pausable=pausable)])
    return Harness(sched)


def _served_to_the_end() -> None:
    h = _harness()
    h.submit("api")
    h.run_until(10)


def _ended_before_the_first_byte() -> None:
    """Every way a dispatched request ends before it has streamed anything."""
    h = _harness(capacity=5, classes=with_reserve(0.0))  # (api takes every slot)
    done, cancelled, late, failed, refused = (h.submit("api") for _ in range(5))
    h.apply(h.sched.complete(done.id, h.now, 0))
    h.cancel(cancelled.id)
    h.apply(h.sched.timed_out(late.id, h.now, "total_timeout"))
    h.apply(h.sched.fail(failed.id, h.now, "upstream_500"))
    h.apply(h.sched.engine_refused(refused.id, h.now, "upstream_400"))


def _ended_while_streaming() -> None:
    h = _harness(capacity=3, classes=with_reserve(0.0))
    cancelled, late, failed = (h.submit("api", output=10**4) for _ in range(3))
    h.run_until(0.1)  # each has its first token
    h.cancel(cancelled.id)
    h.apply(h.sched.timed_out(late.id, h.now, "idle_timeout"))
    h.apply(h.sched.fail(failed.id, h.now, "upstream_500"))
    h.run_until(10)


def _retried_after_a_failed_attempt() -> None:
    h = _harness()
    req = h.submit("api")
    h.fail_attempt(req.id)
    h.run_until(10)


def _refused_at_arrival_and_displaced() -> None:
    h = _harness(admission=Admission(max_queue_total=2))
    h.submit("api", output=10**6)
    h.submit("batch")
    h.submit("offline")
    h.submit("api")  # displaces the offline request
    h.submit("offline")  # nothing below it to displace: refused


def _left_the_queue_without_service() -> None:
    h = _harness()
    h.submit("offline", output=10**6)
    waiting = h.submit("api")
    h.cancel(waiting.id)
    h.submit("api")
    h.run_until(61)  # past api's queue timeout
    h.submit("batch")
    h.apply(h.sched.reject_queued(h.now))


def _preempted_before_and_after_the_first_token() -> None:
    remote = _harness()
    remote.submit("offline")
    remote.submit("realtime")  # pulls the unstarted offline request back
    remote.run_until(10)
    paused = _harness(pausable=True)
    paused.submit("offline", output=100)
    paused.run_until(0.2)  # streaming now: only a pausable engine can take it back
    paused.submit("realtime")
    paused.run_until(10)


SITUATIONS: list[Callable[[], None]] = [
    _served_to_the_end,
    _ended_before_the_first_byte,
    _ended_while_streaming,
    _retried_after_a_failed_attempt,
    _refused_at_arrival_and_displaced,
    _left_the_queue_without_service,
    _preempted_before_and_after_the_first_token,
]


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> Iterator[set[Move]]:
    """Every (from, to) the scheduler performs while the fixture is live."""
    seen: set[Move] = set()
    move = Request.move

    def recorded(req: Request, to: State, reason: str = "") -> None:
        before = req.state
        move(req, to, reason)
        seen.add((before, to))

    monkeypatch.setattr(Request, "move", recorded)
    yield seen


def _table() -> set[Move]:
    return {(a, b) for a, targets in TRANSITIONS.items() for b in targets}


def test_the_table_has_a_row_for_every_state_and_terminal_states_go_nowhere() -> None:
    assert set(TRANSITIONS) == set(State)
    assert all(not TRANSITIONS[s] for s in TERMINAL)
    assert all(TRANSITIONS[s] for s in State if s not in TERMINAL)


def test_the_scheduler_performs_every_move_in_the_table_and_no_other(moves: set[Move]) -> None:
    for situation in SITUATIONS:
        situation()
    assert moves <= _table()  # (``move`` refuses the others; this says so once more)
    never = sorted(f"{a} -> {b}" for a, b in _table() - moves)
    assert not never, f"in the table, never performed: {never}"


def test_a_move_outside_the_table_is_refused() -> None:
    sched = Scheduler(default_config(), "qos", [ReplicaSpec("r0", 1)])
    req = sched.make_request("q1", QosInputs(qos_class="api"), 0.0, 10, 10)
    with pytest.raises(RuntimeError, match="new -> running"):
        req.move(State.RUNNING)
