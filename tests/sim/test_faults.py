"""A fleet that fails, in the simulator: the same core and its replica module, fed the facts the
gateway's upstream client reports (a broken call, a refused connect, a health probe) when a
replica dies, comes back, or slows down. Small hand-made cases on the toy engine.

The cases use the ``batch`` class (which may borrow any reserved room) and keep the runs within
the first probe interval unless they test probing, so they pin the driver's facts, not a window
policy."""

from __future__ import annotations

import pytest

from qosgate.config import Fleet, QosConfig, Retries, default_config
from qosgate.sim.driver import run_policy
from qosgate.sim.results import RequestRecord, RunResult
from qosgate.sim.setup import FaultPlan, ReplicaPlan, SimSetup, scaled
from tests.support.sim import TOY, workload

FAR = 1000.0  # a probe interval longer than any of these runs


def run(
    reqs: list[tuple[float, str, int, int]],
    faults: tuple[FaultPlan, ...] = (),
    *,
    replicas: int = 2,
    window: int = 2,
    pausable: bool = False,
    probe: float = FAR,
    policy: str = "qos",
    cfg: QosConfig | None = None,
) -> RunResult:
    fleet = tuple(ReplicaPlan(f"r{i}", TOY, window, pausable) for i in range(replicas))
    setup = SimSetup(
        cfg=cfg or default_config(),
        profile=TOY,
        replicas=replicas,
        window=window,
        workload=workload(reqs),
        sample_interval=0.05,
        fleet=fleet,
        faults=faults,
        probe_interval=probe,
    )
    return run_policy(setup, policy)


def rec(res: RunResult, rid: str) -> RequestRecord:
    return next(r for r in res.records if r.rid == rid)


def one_outcome_each(res: RunResult) -> None:
    assert res.unfinished == 0
    assert len(res.records) == res.arrivals
    assert len({r.rid for r in res.records}) == res.arrivals
    assert sum(res.outcomes.values()) == res.arrivals


def test_a_death_moves_the_streams_and_retries_the_rest_elsewhere() -> None:
    # r0 takes A (streaming from 0.018 s) and C (a 640-token prompt: ~10 chunked steps of
    # prefill), r1 takes B. r0 dies at 0.1 s: A had streamed, so it continues on r1 from the
    # tokens it delivered (a move); C had sent nothing, so the core retries it: r1 is full
    # (A and B), so, no probe having told it r0 is down, once to r0 (refused), then on r1.
    res = run(
        [(0.0, "batch", 8, 300), (0.0, "batch", 8, 20), (0.0, "batch", 640, 5)],
        (FaultPlan("r0", "die", 0.1),),
    )
    one_outcome_each(res)
    a, b, c = rec(res, "r000000"), rec(res, "r000001"), rec(res, "r000002")
    assert (a.replica, b.replica) == ("r1", "r1")
    assert a.state == "completed" and a.output_tokens == 300 and a.first_token_at < 0.1
    assert res.moves == 1 and 8 < res.resent_tokens < 8 + 300  # its prompt and what it had
    assert b.state == "completed"
    assert c.state == "completed" and c.replica == "r1" and c.failed_attempts == 2
    assert c.first_token_at is not None and c.first_token_at > 0.1
    assert res.fleet["attempt_failures"] == {"upstream_disconnected": 2,
                                             "upstream_unreachable": 1}
    assert res.fleet["retries"] == {"upstream_disconnected": 1, "upstream_unreachable": 1}


def test_without_moves_a_death_fails_the_streams() -> None:
    res = run(
        [(0.0, "batch", 8, 300), (0.0, "batch", 8, 20)],
        (FaultPlan("r0", "die", 0.1),),
        cfg=default_config(fleet=Fleet(retries=Retries(max_moves=0))),
    )
    one_outcome_each(res)
    a = rec(res, "r000000")
    assert a.replica == "r0" and a.state == "failed" and a.reason == "upstream_disconnected"
    assert 0 < a.output_tokens < 300 and a.first_token_at is not None
    assert res.moves == 0


def test_a_request_sent_to_a_dead_replica_is_refused_and_tried_elsewhere() -> None:
    # r0 dies at 0.05 s with nothing on it, and no probe has told the core yet: the next
    # arrival goes to r0 (the most free), is refused at once, and is served by r1
    res = run(
        [(0.0, "batch", 8, 30), (0.1, "batch", 8, 5)],
        (FaultPlan("r0", "die", 0.05),),
        window=1,
    )
    one_outcome_each(res)
    late = rec(res, "r000001")
    assert late.state == "completed" and late.replica == "r1" and late.failed_attempts == 1
    # (the first, streaming on r0 when it died, moved to r1)
    assert res.fleet["attempt_failures"] == {"upstream_unreachable": 1,
                                             "upstream_disconnected": 1}
    assert res.moves == 1


def test_a_dead_replica_is_used_again_after_the_probe_that_finds_it_back() -> None:
    # r0 dies at 0.05 s and is back (empty) at 0.5 s; probes every 0.3 s (0, 0.3, 0.6, ...)
    # find it down at 0.3 and up at 0.6. Steady traffic: from 0.6 s on, r0 serves again.
    reqs = [(0.02 * i, "batch", 8, 10) for i in range(60)]
    res = run(reqs, (FaultPlan("r0", "die", 0.05, until=0.5),), window=1, probe=0.3)
    one_outcome_each(res)
    first = rec(res, "r000000")  # streaming on r0 when it died: it moved to r1
    assert (first.replica, first.state) == ("r1", "completed") and res.moves == 1
    on_r0 = [r for r in res.records if r.replica == "r0" and r.state == "completed"]
    assert not [r for r in on_r0 if (r.first_token_at or 0) < 0.6]  # none while it was out
    assert len(on_r0) >= 5  # and it serves again after the probe that found it back
    assert all(r.state == "completed" for r in res.records)
    assert [f["action"] for f in res.fleet["faults"]] == ["die", "revive"]  # type: ignore[union-attr]
    assert min(s.replicas_up for s in res.samples) == 1


def test_slow_multiplies_every_step_from_its_start() -> None:
    # alone on one replica, slowed x2 from 0.5 s: prefill 2 x 0.042 s, then decodes of
    # 2 x 0.012 s (see test_driver's step arithmetic)
    res = run(
        [(1.0, "batch", 32, 3)], (FaultPlan("r0", "slow", 0.5, factor=2.0),), replicas=1
    )
    r = rec(res, "r000000")
    assert r.first_token_at == pytest.approx(1.0 + 2 * 0.042)
    assert r.finished_at == pytest.approx(1.0 + 2 * 0.042 + 2 * 2 * 0.012)
    assert res.engine["busy_s"] == pytest.approx(2 * 0.066)
    # back to normal speed from ``until``
    res = run(
        [(1.0, "batch", 32, 3)],
        (FaultPlan("r0", "slow", 0.2, until=0.5, factor=2.0),),
        replicas=1,
    )
    assert rec(res, "r000000").finished_at == pytest.approx(1.066)


def test_scaled_profile_multiplies_time_only() -> None:
    p = scaled(TOY, 3.0)
    assert p.step_fixed_s == pytest.approx(0.03)
    assert p.prefill_s_per_token == pytest.approx(0.003)
    assert p.decode_s_per_seq == pytest.approx(0.006)
    assert (p.max_num_seqs, p.max_num_batched_tokens, p.kv_capacity_tokens) == (
        TOY.max_num_seqs,
        TOY.max_num_batched_tokens,
        TOY.kv_capacity_tokens,
    )
    assert scaled(TOY, 1.0) is TOY


def test_paused_requests_lost_with_their_replica_are_told_when_resumed() -> None:
    # one pausable replica, window 2: B1 streams, B2 is in its prefill; two realtime requests
    # arrive and the core pauses both batch requests. r0 dies at 0.2 s: the realtime streams
    # fail, which frees the window, and the core (not yet knowing r0 is down) resumes B1 and B2
    # there at once. Their state died with the engine: B1 had streamed, so it fails (charged
    # the 3 tokens it streamed); B2 had not, so it is retried -- refused by the dead r0, then
    # served after the probe at 0.4 s finds r0 back (restarted at 0.3 s).
    res = run(
        [
            (0.0, "batch", 8, 1000),
            (0.02, "batch", 640, 4),
            (0.05, "realtime", 8, 500),
            (0.05, "realtime", 8, 500),
        ],
        (FaultPlan("r0", "die", 0.2, until=0.3),),
        replicas=1,
        pausable=True,
        probe=0.4,
    )
    one_outcome_each(res)
    b1, b2 = rec(res, "r000000"), rec(res, "r000001")
    rts = [rec(res, "r000002"), rec(res, "r000003")]
    assert res.pauses == 2
    assert all(r.state == "failed" for r in rts)
    assert b1.state == "failed" and b1.reason == "upstream_disconnected"
    assert b1.first_token_at is not None and b1.output_tokens == 3
    assert b1.finished_at == pytest.approx(0.2)
    assert b2.state == "completed" and b2.failed_attempts == 2
    assert b2.first_token_at is not None and b2.first_token_at > 0.4
    assert res.fleet["attempt_failures"] == {
        "upstream_disconnected": 1,
        "upstream_unreachable": 1,
    }


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["fifo", "priority", "wfq", "qos", "engine-priority"])
def test_every_request_has_one_outcome_through_deaths_and_slowdowns(policy: str) -> None:
    reqs = [
        (0.01 * i, ("realtime", "api", "batch", "offline")[i % 4], 16 + (i * 7) % 80, 5 + i % 40)
        for i in range(500)
    ]
    faults = (
        FaultPlan("r0", "die", 0.5, until=2.5),
        FaultPlan("r1", "slow", 1.0, factor=4.0),
        FaultPlan("r2", "die", 3.0),
    )
    for pausable in (False, True):
        res = run(reqs, faults, replicas=3, window=3, pausable=pausable, probe=0.25,
                  policy=policy)
        one_outcome_each(res)
        for r in res.records:
            assert r.state in ("completed", "failed", "timed_out", "rejected")
            if r.state == "completed":
                assert r.output_tokens == r.target_output
            if r.state == "failed":
                assert r.reason.startswith("upstream_")


def test_phases_cut_the_arrival_window_at_each_fault() -> None:
    from qosgate.sim.metrics import Slo, phases

    reqs = [(0.01 * i, ("realtime", "batch")[i % 2], 16, 8) for i in range(201)]
    res = run(
        reqs,
        (FaultPlan("r0", "die", 0.5, until=1.5), FaultPlan("r1", "slow", 1.0, factor=2.0)),
        probe=0.25,
    )
    one_outcome_each(res)
    slos = {c: Slo(1.0, 1.0) for c in ("realtime", "api", "batch", "offline")}
    ph = phases(res, slos)
    assert [(p["start_s"], p["end_s"]) for p in ph] == [
        (0.0, 0.5),
        (0.5, 1.0),
        (1.0, 1.5),
        (1.5, pytest.approx(2.0)),
    ]
    assert [p["fleet"] for p in ph] == [
        "all up",
        "r0 down",
        "r0 down, r1 slow x2",
        "r1 slow x2",
    ]
    assert sum(p["count"] for p in ph) == res.arrivals
    assert all(p["top_class"] == "realtime" for p in ph)


def test_per_replica_stats_carry_the_time_averaged_window() -> None:
    from qosgate.sim.metrics import Slo, replica_stats
    from qosgate.sim.report_tables import _window

    reqs = [(0.01 * i, "batch", 16, 8) for i in range(100)]
    res = run(reqs, (FaultPlan("r0", "die", 0.3, until=0.6),), probe=0.25)
    stats = replica_stats(res, lambda r: Slo(1.0, 1.0))
    assert set(stats) == {"r0", "r1"}
    for g in stats.values():
        assert g["window"] == 2 and g["gpu"] == "none"
        assert 1 <= g["window_mean"] <= 2
    assert sum(g["count"] for g in stats.values()) == res.arrivals
    assert len(res.samples[0].windows) == 2
    assert _window({"window": 748, "window_mean": 748.2}) == "748"
    assert _window({"window": 748, "window_mean": 212.4}) == "212/748"
    assert _window({"window": None}) == "-"
    assert _window({"window": 1 << 30, "window_mean": float(1 << 30)}) == "all"
