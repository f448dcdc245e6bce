"""The virtual-time driver with the real core and the real engine model: step times computed by
hand, KV preemption, the core's preemptions carried out on the engine, one outcome per request."""

from __future__ import annotations

import math

import pytest

from qosgate.config import config_from_mapping, default_config
from qosgate.sim.results import RequestRecord, RunResult
from qosgate.sim.setup import SIM_POLICIES, policy_setup
from tests.support.classes import with_reserve
from tests.support.sim import simulate, toy


def rec(result: RunResult, rid: str) -> RequestRecord:
    return next(r for r in result.records if r.rid == rid)


def ledger_balances(result: RunResult) -> None:
    assert result.unfinished == 0
    assert len(result.records) == result.arrivals
    assert len({r.rid for r in result.records}) == result.arrivals
    assert sum(result.outcomes.values()) == result.arrivals


def test_single_request_step_times_by_hand() -> None:
    # prefill step: 0.01 + 32 * 0.001 = 0.042 -> first token at 1.042
    # two decode steps of 0.01 + 1 * 0.002 = 0.012 -> done at 1.066
    res = simulate([(1.0, "api", 32, 3)])
    r = rec(res, "r000000")
    assert r.state == "completed"
    assert r.first_token_at == pytest.approx(1.042)
    assert r.finished_at == pytest.approx(1.066)
    assert r.output_tokens == 3
    assert res.engine["steps"] == 3
    assert res.engine["busy_s"] == pytest.approx(0.066)
    ledger_balances(res)


def test_chunked_prefill_and_batching_by_hand() -> None:
    # two requests at t=0, prompts 40 + 40 > budget 64: step 1 prefills 40 + 24 (0.074 s; A's
    # first token), step 2 decodes A (1 token) and prefills B's last 16 (0.01+0.016+0.002=0.028,
    # B's first token at 0.102), then both decode together (0.01 + 2*0.002 = 0.014 per step).
    res = simulate([(0.0, "api", 40, 2), (0.0, "api", 40, 2)])
    a, b = rec(res, "r000000"), rec(res, "r000001")
    assert a.first_token_at == pytest.approx(0.074)
    assert b.first_token_at == pytest.approx(0.102)
    assert a.finished_at == pytest.approx(0.102)  # A's 2nd token in step 2
    assert b.finished_at == pytest.approx(0.102 + 0.012)  # B decodes alone (A finished)


def test_idle_engine_starts_at_arrival_busy_engine_at_next_step() -> None:
    # A alone: prefill 0.01+0.010=0.020, then decodes of 0.012 each. B arrives at 0.025,
    # mid-step (step 2 runs 0.020..0.032): it joins at 0.032 with a prefill of 10 tokens plus
    # A's decode: 0.01 + 0.010 + 0.002 = 0.022 -> B's first token at 0.054.
    res = simulate([(0.0, "api", 10, 5), (0.025, "api", 10, 2)])
    assert rec(res, "r000000").first_token_at == pytest.approx(0.020)
    assert rec(res, "r000001").first_token_at == pytest.approx(0.054)


def test_kv_preemption_recomputes_and_completes_everything() -> None:
    # KV for 200 tokens, four requests of 40 + 40: they cannot all fit, so the engine evicts
    # (recompute) and every request still completes with exactly its output.
    prof = toy(kv_capacity_tokens=200)
    res = simulate([(0.0, "api", 40, 40) for _ in range(4)], profile=prof)
    ledger_balances(res)
    assert res.engine["kv_evictions"] > 0
    for r in res.records:
        assert r.state == "completed"
        assert r.output_tokens == 40


def test_window_limits_inflight_and_queue_holds_the_rest() -> None:
    res = simulate([(0.0, "api", 8, 20) for _ in range(6)], window=2)
    ledger_balances(res)
    assert max(s.inflight for s in res.samples) <= 2
    assert max(sum(s.queued) for s in res.samples) >= 1
    # served two at a time: the last pair starts only after two have finished
    firsts = sorted(r.first_token_at for r in res.records if r.first_token_at is not None)
    finishes = sorted(r.finished_at for r in res.records)
    assert firsts[4] >= finishes[1] - 1e-9


def test_realtime_pauses_a_decoding_batch_request_which_resumes_intact() -> None:
    # window 1: a long batch request runs; a realtime request arrives and the core preempts the
    # batch one (it is past its first token: pause). Realtime is served, then batch resumes and
    # finishes with all its tokens.
    res = simulate([(0.0, "batch", 8, 200), (0.5, "realtime", 8, 5)], window=1)
    ledger_balances(res)
    b, rt = rec(res, "r000000"), rec(res, "r000001")
    assert res.pauses == 1 and res.aborts == 0
    assert rt.state == b.state == "completed"
    assert rt.first_token_at is not None and rt.first_token_at - rt.arrival < 0.1
    assert b.output_tokens == 200
    assert b.preemptions == 1
    assert b.finished_at > rt.finished_at


def test_realtime_pauses_a_batch_request_still_in_prefill() -> None:
    # a 640-token prompt takes 10 chunked steps; realtime arrives during its prefill: the core
    # pauses it (the engine keeps its partial KV, no work is lost) and resumes it later.
    res = simulate([(0.0, "batch", 640, 3), (0.1, "realtime", 8, 3)], window=1)
    ledger_balances(res)
    b, rt = rec(res, "r000000"), rec(res, "r000001")
    assert res.aborts == 0 and res.pauses == 1
    assert rt.first_token_at is not None and b.first_token_at is not None
    assert rt.first_token_at < b.first_token_at
    assert b.state == "completed" and b.output_tokens == 3


def test_paused_request_that_times_out_is_freed_in_the_engine() -> None:
    cfg = default_config()
    data = cfg.model_dump()
    for c in data["classes"]:
        if c["name"] == "batch":
            c["queue_timeout_s"] = 1.0
    cfg = config_from_mapping(data)
    res = simulate([(0.0, "batch", 8, 1000), (0.5, "realtime", 8, 300)], window=1, cfg=cfg)
    ledger_balances(res)
    b = rec(res, "r000000")
    assert b.state == "timed_out"
    assert 0 < b.output_tokens < 1000  # what it streamed before it was paused
    assert rec(res, "r000001").state == "completed"


@pytest.mark.parametrize("policy", SIM_POLICIES)
def test_overload_every_request_has_one_outcome(policy: str) -> None:
    reqs = [
        (0.01 * i, ("realtime", "api", "batch", "offline")[i % 4], 16 + (i * 7) % 50, 5 + i % 30)
        for i in range(400)
    ]
    res = simulate(reqs, policy=policy, window=4)
    ledger_balances(res)
    completed = [r for r in res.records if r.state == "completed"]
    assert completed
    for r in completed:
        assert r.first_token_at is not None
        assert r.arrival <= r.first_token_at <= r.finished_at
        assert r.output_tokens == r.target_output


def test_engine_priority_passes_everything_through() -> None:
    assert policy_setup("engine-priority").passthrough
    assert policy_setup("engine-priority").engine_queue == "priority"
    assert policy_setup("fifo").engine_queue == "fcfs"
    assert policy_setup("qos").engine_queue == "priority"
    assert policy_setup("qos", "fcfs").engine_queue == "fcfs"
    reqs = [(0.0, "offline", 16, 50)] * 8 + [(0.05, "realtime", 16, 5)]
    res = simulate(reqs, policy="engine-priority")
    ledger_balances(res)
    assert max(sum(s.queued) for s in res.samples) == 0  # nothing waits in qosgate
    rt = rec(res, "r000008")
    # the engine's own priority queue runs realtime ahead of the waiting offline requests
    waiting_offline = [r for r in res.records if r.service_class == "offline"]
    assert rt.first_token_at is not None
    assert sum(1 for r in waiting_offline if (r.first_token_at or 0) > rt.first_token_at) >= 4


def test_two_replicas_share_the_load() -> None:
    reqs = [(0.0, "api", 16, 40) for _ in range(8)]
    cfg = default_config(classes=with_reserve(0.0))  # (api takes every slot of the 4)
    one = simulate(reqs, window=4, replicas=1, cfg=cfg)
    two = simulate(reqs, window=4, replicas=2, cfg=cfg)
    ledger_balances(two)
    assert two.makespan < one.makespan
    assert max(s.inflight for s in two.samples) == 8


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy"):
        policy_setup("lottery")


def test_window_end_snapshot_counts_tokens_so_far() -> None:
    # one request decoding across the end of the arrival span: its tokens by then are counted
    res = simulate([(0.0, "api", 8, 500)], duration=1.0)
    r = rec(res, "r000000")
    # prefill 0.018 s, then 0.012 s per token: ~81 tokens by t = 1.0 (to within one step)
    expected = 1 + math.floor((1.0 - 0.018) / 0.012)
    assert abs(r.win_output - expected) <= 1
    assert res.engine_window["generated_tokens"] == pytest.approx(r.win_output, abs=1)
    assert r.output_tokens == 500


def test_finish_in_the_step_under_way_at_a_pause_is_reported_on_resume() -> None:
    # batch B: first token at 0.018, then 0.030, and its 3rd and last token at 0.042. Realtime
    # arrives at 0.035, inside B's last step: the core pauses B (running), but that step is
    # already under way and finishes B. The finish is held and reported when B is resumed.
    res = simulate([(0.0, "batch", 8, 3), (0.035, "realtime", 8, 2)], window=1)
    ledger_balances(res)
    b, rt = rec(res, "r000000"), rec(res, "r000001")
    assert res.pauses == 1 and res.late_finishes == 1
    assert b.state == "completed" and b.output_tokens == 3
    assert rt.finished_at is not None and b.finished_at >= rt.finished_at


def test_driver_tolerates_a_core_that_pauses_before_the_first_token(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a core that pauses (rather than aborts) a victim still in prefill on a pausable replica:
    # the first token produced in the step under way is held and reported on resume
    from qosgate.core import scheduler as core_scheduler
    from qosgate.core.decisions import Preempt
    from qosgate.core.request import State

    def preempt_for(self: core_scheduler.Scheduler, req: object, now: float, out: list) -> None:  # type: ignore[type-arg]
        victim = next(iter(self._preemptible.values()), None)
        if victim is None:
            return
        rep = self.replicas[victim.replica or ""]
        self._release_slot(victim)
        victim.move(State.PREEMPTED, "preempted")
        victim.preemptions += 1
        self.policy.settle(victim, -victim.cost)
        self._enqueue(victim, now)
        out.append(Preempt(victim, rep.name, True))

    monkeypatch.setattr(core_scheduler.Scheduler, "_preempt_for", preempt_for)
    res = simulate([(0.0, "batch", 8, 3), (0.01, "realtime", 8, 2)], window=1)
    ledger_balances(res)
    b = rec(res, "r000000")
    assert res.pauses == 1 and res.aborts == 0 and res.late_finishes == 1
    assert b.state == "completed" and b.output_tokens == 3
    assert b.first_token_at is not None and b.first_token_at > 0.018


def test_engine_priority_holds_nothing_next_to_realtime_streams() -> None:
    # realtime streams run while long lower-class prompts arrive: the core's prefill budget and
    # realtime's reserved share would hold them in qosgate; engine priority alone passes them on
    reqs = [(0.0, "realtime", 8, 400), (0.0, "realtime", 8, 400)]
    reqs += [(0.1 + 0.01 * i, ("api", "batch")[i % 2], 900, 5) for i in range(12)]
    res = simulate(reqs, policy="engine-priority", profile=toy(kv_capacity_tokens=100_000))
    ledger_balances(res)
    assert max(sum(s.queued) for s in res.samples) == 0
    assert all(r.state == "completed" for r in res.records)
