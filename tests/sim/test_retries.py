"""Clients that honour Retry-After (``--retries``): a refused request comes back as a new
request of its own (its own outcome), linked to the first, at the time the refusal gave."""

from __future__ import annotations

from dataclasses import replace

from qosgate.sim.driver import run_policy
from qosgate.sim.metrics import Slo, retry_stats
from tests.support.sim import crowded_api, workload


def test_without_retries_a_refusal_is_final() -> None:
    res = run_policy(crowded_api(0), "qos")
    assert res.arrivals == len(res.records) == 10
    refused = [r for r in res.records if r.state == "rejected"]
    assert len(refused) == 4 and all(r.reason == "class_queue_full" for r in refused)
    assert all(r.attempt == 0 and not r.retry_of for r in res.records)


def test_refused_requests_come_back_at_their_retry_after_and_are_served() -> None:
    res = run_policy(crowded_api(2), "qos")
    recs = {r.rid: r for r in res.records}
    first = [r for r in res.records if r.attempt == 0]
    retried = [r for r in res.records if r.attempt > 0]
    assert len(first) == 10 and len(retried) == 4
    # one outcome each, the retries counted as requests of their own
    assert res.arrivals == len(res.records) == len(recs) == 14
    assert sum(res.outcomes.values()) == 14 and res.unfinished == 0
    for r in retried:
        orig = recs[r.retry_of]
        assert orig.state == "rejected" and r.attempt == 1
        assert r.arrival >= orig.arrival + 1.0  # the refusal's Retry-After (at least 1 s)
        assert r.state == "completed"  # by then the first four had finished
    stats = retry_stats(res, {c: Slo(60.0, 1.0) for c in res.classes})
    assert stats["api"]["refused_first"] == 4
    assert stats["api"]["served_later"] == 4 and stats["api"]["gave_up"] == 0
    assert stats["api"]["ttft_from_first_p50_ms"] >= 1000.0


def test_a_client_gives_up_after_its_retries() -> None:
    setup = crowded_api(1)
    # arrivals keep the queue full: the retries at t ~ 1 s find it full again
    burst = [(t / 10, "api", 10, 400) for t in range(40)]
    res = run_policy(replace(setup, workload=workload(burst)), "qos")
    first = {r.rid: r for r in res.records if r.attempt == 0}
    retried = [r for r in res.records if r.attempt > 0]
    assert retried and all(r.attempt == 1 for r in retried)
    assert len(res.records) == res.arrivals == len(first) + len(retried)
    stats = retry_stats(res, {c: Slo(60.0, 1.0) for c in res.classes})["api"]
    assert stats["refused_first"] == len(retried)
    assert stats["gave_up"] == sum(1 for r in retried if r.state == "rejected") > 0
