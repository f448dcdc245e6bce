"""Clients that honour Retry-After (``--retries``): a refused request comes back as a new
request of its own (its own outcome), linked to the first, at the time the refusal gave."""

from __future__ import annotations

from dataclasses import replace

from qosgate.config import default_config
from qosgate.sim.driver import run_policy
from qosgate.sim.metrics import Slo, retry_stats
from qosgate.sim.setup import SimSetup
from tests.support.classes import with_reserve
from tests.support.sim import TOY, workload


def _setup(retries: int) -> SimSetup:
    # (no reserve: api takes every slot of the toy engine's small window)
    cfg = default_config(classes=with_reserve(0.0))
    classes = [c.model_copy(update={"max_queue": 2}) if c.name == "api" else c
               for c in cfg.classes]
    return SimSetup(
        cfg=cfg.model_copy(update={"classes": tuple(classes)}),
        profile=TOY,
        replicas=1,
        window=TOY.max_num_seqs,
        workload=workload([(0.0, "api", 10, 50)] * 10),
        sample_interval=0.05,
        retries=retries,
    )


def test_without_retries_a_refusal_is_final() -> None:
    res = run_policy(_setup(0), "qos")
    assert res.arrivals == len(res.records) == 10
    refused = [r for r in res.records if r.state == "rejected"]
    assert len(refused) == 4 and all(r.reason == "class_queue_full" for r in refused)
    assert all(r.attempt == 0 and not r.retry_of for r in res.records)


def test_refused_requests_come_back_at_their_retry_after_and_are_served() -> None:
    res = run_policy(_setup(2), "qos")
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
    setup = _setup(1)
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
