"""The batch feed policy: bounded lines per tenant, earliest deadline first, and the retry rule."""

from __future__ import annotations

import random

from qosgate.core.batches_feed import FeedBatch, Next, RetryRule, SpareCapacity, after_failure, plan

RULE = RetryRule(retries=3, backoff_s=1.0, backoff_max_s=5.0)


def job(id: str, deadline: float, in_flight: int = 0, ready: int = 1000,
        tenant: str = "t") -> FeedBatch:
    return FeedBatch(id, tenant, deadline, in_flight, ready)


def test_an_idle_fleet_gets_its_capacity_plus_a_short_queue() -> None:
    assert plan([job("a", 10)], queued_per_job=4, spare=16) == [("a", 20)]


def test_a_job_with_its_lines_in_flight_gets_nothing_more() -> None:
    assert plan([job("a", 10, in_flight=20)], queued_per_job=4, spare=16) == []
    assert plan([job("a", 10, in_flight=15)], queued_per_job=4, spare=16) == [("a", 5)]


def test_never_more_than_the_lines_ready() -> None:
    assert plan([job("a", 10, ready=3)], queued_per_job=4, spare=16) == [("a", 3)]


def test_earliest_deadline_first_within_a_tenant() -> None:
    jobs = [job("late", 50), job("soon", 10, ready=5)]
    assert plan(jobs, queued_per_job=2, spare=6) == [("soon", 5), ("late", 3)]


def test_the_tenants_with_jobs_split_the_spare_slots() -> None:
    jobs = [job("a", 10, in_flight=8), job("b", 50, tenant="u")]
    assert plan(jobs, queued_per_job=2, spare=6) == [("b", 5)]  # each: 3 of 6, plus 2 queued
    jobs = [job("a", 10, in_flight=1), job("b", 50, tenant="u")]
    assert plan(jobs, queued_per_job=0, spare=7) == [("a", 3), ("b", 4)]


def test_no_capacity_still_keeps_a_queue() -> None:
    assert plan([job("a", 10)], queued_per_job=2, spare=0) == [("a", 2)]


def test_with_no_live_traffic_a_job_has_the_whole_fleet_once_a_window_was_watched() -> None:
    spare = SpareCapacity(lookback_s=30.0, headroom=0.05)
    assert spare.spare(0.0, 32) == 0  # nothing watched yet
    spare.observe(0.0, 0)
    assert spare.spare(0.0, 32) == 0
    assert spare.spare(15.0, 32) == 16  # half the window watched: half the fleet
    assert spare.spare(30.0, 32) == 32
    assert spare.spare(100.0, 32) == 32


def test_live_traffic_keeps_its_recent_peak_and_a_headroom() -> None:
    spare = SpareCapacity(lookback_s=30.0, headroom=0.05)
    spare.observe(-30.0, 0)  # watched for a window already
    spare.observe(0.0, 3)
    spare.observe(1.0, 9)  # a burst
    spare.observe(2.0, 2)
    assert spare.spare(2.0, 32) == 32 - 9 - 2  # the peak, and 5% of 32 rounded up
    assert spare.spare(30.5, 32) == 32 - 9 - 2  # the burst is 29.5 s old: still counted
    assert spare.spare(31.5, 32) == 32 - 2 - 2  # gone: the present count
    spare.observe(40.0, 0)
    assert spare.spare(80.0, 32) == 32  # quiet for a whole window
    assert spare.spare(80.0, 4) == 4


def test_a_fleet_full_of_live_traffic_leaves_nothing_spare() -> None:
    spare = SpareCapacity(lookback_s=10.0, headroom=0.0)
    spare.observe(-10.0, 0)
    spare.observe(0.0, 40)
    assert spare.spare(1.0, 32) == 0
    spare.observe(1.0, 1)
    assert spare.spare(1.0, 32) == 0  # the peak of 40 is still in the window


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
