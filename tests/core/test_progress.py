"""The engine-progress rules: a whole answer's bound, and when an engine is stalled."""

from __future__ import annotations

import pytest

from qosgate.core.progress import StallWatch, whole_answer_s


def test_a_whole_answers_bound_is_the_first_bytes_plus_its_cap_at_the_token_time() -> None:
    assert whole_answer_s(30.0, 100, 0.02, assumed_token_s=0.1, margin=3.0) == pytest.approx(36.0)
    # not measured yet: the assumed time per token
    assert whole_answer_s(30.0, 100, None, assumed_token_s=0.1, margin=3.0) == pytest.approx(60.0)
    # no output bound known: the first byte's bound alone (the call's total bound still holds)
    assert whole_answer_s(30.0, None, 0.02, assumed_token_s=0.1, margin=3.0) == 30.0


def test_stalled_only_when_the_counter_stands_still_for_stall_s_while_busy() -> None:
    w = StallWatch(10.0)
    assert not w.observe(0.0, counter=5, answered=True, busy=True)
    assert not w.observe(9.9, counter=5, answered=True, busy=True)
    assert w.observe(10.0, counter=5, answered=True, busy=True)
    # it moves: not stalled, and the clock starts again
    assert not w.observe(11.0, counter=6, answered=True, busy=True)
    assert not w.observe(20.9, counter=6, answered=True, busy=True)
    assert w.observe(21.0, counter=6, answered=True, busy=True)


def test_idle_is_never_stalled_and_work_starts_the_clock() -> None:
    w = StallWatch(10.0)
    assert not w.observe(0.0, counter=5, answered=True, busy=False)
    assert not w.observe(100.0, counter=5, answered=True, busy=False)
    assert not w.observe(101.0, counter=5, answered=True, busy=True)
    assert w.observe(111.0, counter=5, answered=True, busy=True)
    assert not w.observe(112.0, counter=5, answered=True, busy=False)


def test_an_unanswered_probe_is_no_progress_and_no_counters_is_never_judged() -> None:
    hung = StallWatch(10.0)
    assert not hung.observe(0.0, counter=None, answered=False, busy=True)
    assert hung.observe(10.0, counter=None, answered=False, busy=True)
    blind = StallWatch(10.0)  # an engine that exports no token counters (answers its probes)
    assert not blind.observe(0.0, counter=None, answered=True, busy=True)
    assert not blind.observe(1000.0, counter=None, answered=True, busy=True)
