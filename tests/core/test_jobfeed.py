"""The batch feed policy: bounded lines per tenant, earliest deadline first, and the retry rule."""

from __future__ import annotations

import random

from qosgate.core.jobfeed import FeedJob, Next, RetryRule, after_failure, plan

RULE = RetryRule(retries=3, backoff_s=1.0, backoff_max_s=5.0)


def job(id: str, deadline: float, in_flight: int = 0, ready: int = 1000,
        tenant: str = "t") -> FeedJob:
    return FeedJob(id, tenant, deadline, in_flight, ready)


def test_an_idle_fleet_gets_its_capacity_plus_a_short_queue() -> None:
    assert plan([job("a", 10)], queued_per_job=4, capacity=16) == [("a", 20)]


def test_a_job_with_its_lines_in_flight_gets_nothing_more() -> None:
    assert plan([job("a", 10, in_flight=20)], queued_per_job=4, capacity=16) == []
    assert plan([job("a", 10, in_flight=15)], queued_per_job=4, capacity=16) == [("a", 5)]


def test_never_more_than_the_lines_ready() -> None:
    assert plan([job("a", 10, ready=3)], queued_per_job=4, capacity=16) == [("a", 3)]


def test_earliest_deadline_first_within_a_tenant() -> None:
    jobs = [job("late", 50), job("soon", 10, ready=5)]
    assert plan(jobs, queued_per_job=2, capacity=6) == [("soon", 5), ("late", 3)]


def test_each_tenant_has_its_own_bound() -> None:
    jobs = [job("a", 10, in_flight=8), job("b", 50, tenant="u")]
    assert plan(jobs, queued_per_job=2, capacity=6) == [("b", 8)]


def test_no_capacity_still_keeps_a_queue() -> None:
    assert plan([job("a", 10)], queued_per_job=2, capacity=0) == [("a", 2)]


def test_a_client_error_is_final_at_once() -> None:
    v = after_failure(400, None, 0, 100.0, RULE, random.Random(1))
    assert v.next is Next.FINAL


def test_a_refusal_that_asks_to_wait_spends_no_attempt() -> None:
    for status in (429, 503):
        v = after_failure(status, 7.0, 3, 100.0, RULE, random.Random(1))
        assert v.next is Next.WAIT and v.at == 107.0
    # a rate limit with no Retry-After waits the first back-off
    assert after_failure(429, None, 9, 100.0, RULE, random.Random(1)).at == 101.0


def test_engine_failures_back_off_doubling_up_to_the_longest_then_are_final() -> None:
    rng = random.Random(7)
    for attempts, full in ((0, 1.0), (1, 2.0), (2, 4.0)):
        for status in (500, 502, 503, 504, None):
            v = after_failure(status, None, attempts, 100.0, RULE, rng)
            assert v.next is Next.RETRY
            assert 100.0 + full / 2 <= v.at <= 100.0 + full
    long = RetryRule(retries=10, backoff_s=1.0, backoff_max_s=5.0)
    assert after_failure(500, None, 8, 0.0, long, rng).at <= 5.0
    assert after_failure(500, None, 3, 100.0, RULE, rng).next is Next.FINAL


def test_the_jitter_is_seeded() -> None:
    a = [after_failure(500, None, 1, 0.0, RULE, random.Random(3)).at for _ in range(2)]
    assert a[0] == a[1]
    spread = {after_failure(500, None, 1, 0.0, RULE, random.Random(s)).at for s in range(20)}
    assert len(spread) > 1
