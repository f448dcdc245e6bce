"""Simulated engine: step-time arithmetic, batching, KV eviction, policies, fast path."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.models.simmodel import (
    Policy,
    SimEngine,
    available_profiles,
    load_profile,
)
from qosgate.models.step import EvictEvent, FinishEvent, SeqSpec, StepResult, TokenEvent
from tests.support.simmodel import TOY, run_all, toy


def spec(sid: str, prompt: int, out: int, max_tokens: int = 1000, prio: int = 0) -> SeqSpec:
    return SeqSpec(sid, prompt, max_tokens, target_output_tokens=out, engine_priority=prio)


def tokens_by_seq(results: list[StepResult]) -> dict[str, list[int]]:
    seen: dict[str, list[int]] = defaultdict(list)
    for r in results:
        for t in r.tokens:
            seen[t.seq_id].append(t.index)
    return seen


def test_step_time_hand_computed() -> None:
    eng = SimEngine(TOY)
    eng.add(spec("a", 10, 3))
    r1 = eng.step()  # prefill 10 tokens
    assert r1.duration_s == pytest.approx(0.01 + 10 * 0.001)
    assert [(t.seq_id, t.index) for t in r1.tokens] == [("a", 0)]
    eng.add(spec("b", 5, 3))
    r2 = eng.step()  # a decodes with context 10 + 1, b prefills 5
    assert r2.duration_s == pytest.approx(0.01 + 5 * 0.001 + 11 * 0.0001 + 0.002)
    assert sorted((t.seq_id, t.index) for t in r2.tokens) == [("a", 1), ("b", 0)]
    r3 = eng.step()  # a (ctx 12) and b (ctx 6) decode; a finishes with its 3rd token
    assert r3.duration_s == pytest.approx(0.01 + (12 + 6) * 0.0001 + 2 * 0.002)
    assert r3.finished == [FinishEvent("a", "stop", 10, 3)]
    r4 = eng.step()
    assert r4.duration_s == pytest.approx(0.01 + 7 * 0.0001 + 0.002)
    assert r4.finished == [FinishEvent("b", "stop", 5, 3)]
    assert not eng.has_work()
    m = eng.metrics()
    assert (m.prompt_tokens_total, m.generation_tokens_total, m.steps_total) == (15, 6, 4)
    assert m.busy_s_total == pytest.approx(sum(r.duration_s for r in (r1, r2, r3, r4)))
    assert m.kv_usage == 0
    # inter-token latency: each token after a seq's first counts its step (a: r2, r3; b: r3, r4)
    assert m.itl_tokens_total == 4
    assert m.itl_s_total == pytest.approx(r2.duration_s + 2 * r3.duration_s + r4.duration_s)


def test_finish_reason_length_when_max_tokens_hit() -> None:
    eng = SimEngine(TOY)
    eng.add(spec("a", 4, out=50, max_tokens=3))
    eng.add(SeqSpec("b", 4, max_tokens=2))  # no target: generates up to max_tokens
    fins = {f.seq_id: f for r in run_all(eng) for f in r.finished}
    assert fins["a"] == FinishEvent("a", "length", 4, 3)
    assert fins["b"] == FinishEvent("b", "length", 4, 2)


def test_chunked_prefill_first_token_in_right_step() -> None:
    eng = SimEngine(toy(max_num_batched_tokens=8))
    eng.add(spec("d", 3, 100))
    assert eng.step().tokens[0].index == 0  # d is now decoding and takes 1 token per step
    eng.add(spec("p", 20, 2))
    durations, got_first = [], []
    for _ in range(3):  # p gets 7 + 7 tokens, then its last 6: first token in the 3rd step
        r = eng.step()
        durations.append(r.duration_s)
        got_first.append(("p", 0) in [(t.seq_id, t.index) for t in r.tokens])
    assert got_first == [False, False, True]
    assert durations[0] == pytest.approx(0.01 + 7 * 0.001 + 4 * 0.0001 + 0.002)
    assert durations[2] == pytest.approx(0.01 + 6 * 0.001 + 6 * 0.0001 + 0.002)


def test_max_num_seqs_respected() -> None:
    eng = SimEngine(toy(max_num_seqs=2))
    for i in range(5):
        eng.add(spec(f"s{i}", 4, 3 + i))
    while eng.has_work():
        eng.step()
        m = eng.metrics()
        assert m.num_running <= 2
        assert m.num_running + m.num_waiting <= 5


def test_kv_eviction_and_recompute_without_repeats() -> None:
    # Both fit at admission (2 x 10 prompt) but not at full length (2 x 30 > 45): one is evicted.
    eng = SimEngine(toy(kv_capacity_tokens=45))
    eng.add(spec("a", 10, 20))
    eng.add(spec("b", 10, 20))
    results = run_all(eng)
    evicted = [e.seq_id for r in results for e in r.evicted]
    assert evicted and evicted[0] == "b"  # fcfs: most recently admitted goes first
    seen = tokens_by_seq(results)
    assert seen["a"] == list(range(20))
    assert seen["b"] == list(range(20))
    fins = {f.seq_id: f.completion_tokens for r in results for f in r.finished}
    assert fins == {"a": 20, "b": 20}
    assert eng.metrics().preemptions_total == len(evicted)
    # The readmitted seq re-prefilled prompt + generated tokens (one long prefill step).
    assert max(r.duration_s for r in results) > 0.01 + 10 * 0.001


def test_kv_usage_never_exceeds_capacity() -> None:
    eng = SimEngine(toy(kv_capacity_tokens=60, max_num_seqs=8))
    for i in range(6):
        eng.add(spec(f"s{i}", 8 + i, 15))
    while eng.has_work():
        eng.step()
        assert 0 <= eng.metrics().kv_usage <= 1


def test_priority_orders_waiting_queue() -> None:
    eng = SimEngine(toy(max_num_seqs=1), policy="priority")
    eng.add(spec("first", 4, 2, prio=0))
    eng.step()  # "first" runs
    for sid, prio in (("p5", 5), ("p1", 1), ("p3", 3), ("p1b", 1)):
        eng.add(spec(sid, 4, 2, prio=prio))
    firsts = [t.seq_id for r in run_all(eng) for t in r.tokens if t.index == 0]
    assert firsts == ["p1", "p1b", "p3", "p5"]


def test_fcfs_ignores_priority() -> None:
    eng = SimEngine(toy(max_num_seqs=1), policy="fcfs")
    for sid, prio in (("a", 5), ("b", 1), ("c", 3)):
        eng.add(spec(sid, 4, 2, prio=prio))
    firsts = [t.seq_id for r in run_all(eng) for t in r.tokens if t.index == 0]
    assert firsts == ["a", "b", "c"]


def test_priority_orders_the_waiting_queue_and_never_preempts_a_running_seq() -> None:
    """vLLM V1's priority scheduling (0.32 included, vLLM issue #40004): a waiting seq with a
    smaller value goes ahead of the other waiting ones, but waits for a free slot like them."""
    eng = SimEngine(toy(max_num_seqs=1), policy="priority")
    eng.add(spec("low", 4, 10, prio=5))
    eng.step()
    eng.step()  # low has emitted tokens 0 and 1
    eng.add(spec("mid", 4, 3, prio=3))
    eng.add(spec("high", 4, 3, prio=0))
    results = run_all(eng)
    assert all(not r.evicted for r in results)
    assert tokens_by_seq(results)["low"] == list(range(2, 10))
    fins = [f.seq_id for r in results for f in r.finished]
    assert fins == ["low", "high", "mid"]


def test_priority_preempts_running_with_larger_value_under_v0s_rule() -> None:
    eng = SimEngine(toy(max_num_seqs=1), policy="priority", preempt_for_priority=True)
    eng.add(spec("low", 4, 10, prio=5))
    r = eng.step()
    eng.step()  # low has emitted tokens 0 and 1
    eng.add(spec("high", 4, 3, prio=0))
    r = eng.step()
    assert r.evicted == [EvictEvent("low")]
    assert [(t.seq_id, t.index) for t in r.tokens] == [("high", 0)]
    results = run_all(eng)
    seen = tokens_by_seq(results)
    assert seen["high"] == [1, 2]
    assert seen["low"] == list(range(2, 10))  # resumes after re-prefill, no index repeated
    fins = [f.seq_id for r in results for f in r.finished]
    assert fins == ["high", "low"]


def test_priority_equal_value_does_not_preempt() -> None:
    eng = SimEngine(toy(max_num_seqs=1), policy="priority", preempt_for_priority=True)
    eng.add(spec("a", 4, 5, prio=1))
    eng.step()
    eng.add(spec("b", 4, 5, prio=1))
    assert all(not r.evicted for r in run_all(eng))


def test_priority_kv_victim_is_largest_value() -> None:
    eng = SimEngine(toy(kv_capacity_tokens=60), policy="priority")
    eng.add(spec("hi", 10, 25, prio=0))
    eng.add(spec("lo", 10, 25, prio=9))
    eng.add(spec("mid", 10, 25, prio=4))
    results = run_all(eng)
    evicted = [e.seq_id for r in results for e in r.evicted]
    assert evicted[0] == "lo"
    assert "hi" not in evicted
    seen = tokens_by_seq(results)
    assert all(seen[s] == list(range(25)) for s in ("hi", "lo", "mid"))


def test_pause_resume_keeps_count_and_kv() -> None:
    eng = SimEngine(TOY)
    eng.add(spec("a", 10, 6))
    eng.add(spec("b", 10, 6))
    got: list[int] = []
    for _ in range(3):
        got += [t.index for t in eng.step().tokens if t.seq_id == "a"]
    eng.pause("a")
    kv_paused = eng.metrics().kv_usage * TOY.kv_capacity_tokens
    assert kv_paused >= 12  # a keeps its 12 tokens of KV while b runs
    assert eng.metrics().num_paused == 1
    r = eng.step()
    assert all(t.seq_id == "b" for t in r.tokens)
    assert r.duration_s == pytest.approx(0.01 + 13 * 0.0001 + 0.002)  # only b in the batch
    eng.resume("a")
    results = run_all(eng)
    got += tokens_by_seq(results)["a"]
    assert got == list(range(6))
    assert eng.metrics().preemptions_total == 0


def test_pause_all_then_nothing_runs() -> None:
    eng = SimEngine(TOY)
    eng.add(spec("a", 10, 6))
    eng.step()
    eng.pause("a")
    assert not eng.has_work()
    adv = eng.advance(math.inf, 1.0)
    assert (adv.now, adv.steps, adv.events) == (1.0, 0, [])
    eng.resume("a")
    assert [t.index for r in run_all(eng) for t in r.tokens] == [1, 2, 3, 4, 5]


def test_abort_frees_capacity() -> None:
    eng = SimEngine(toy(kv_capacity_tokens=40, max_num_seqs=1))
    eng.add(spec("big", 30, 5))
    eng.add(spec("next", 30, 2))
    eng.step()
    assert eng.metrics().kv_usage == pytest.approx(30 / 40)
    eng.abort("big")
    assert eng.metrics().kv_usage == 0
    assert eng.metrics().num_running == 0
    r = eng.step()
    assert [(t.seq_id, t.index) for t in r.tokens] == [("next", 0)]
    eng.abort("next")
    eng.abort("next")  # idempotent: aborting races with finishing
    assert not eng.has_work()
    assert eng.metrics().kv_usage == 0


def test_abort_paused_and_waiting() -> None:
    eng = SimEngine(toy(max_num_seqs=1))
    eng.add(spec("a", 10, 6))
    eng.add(spec("w", 10, 6))
    eng.step()
    eng.pause("a")
    eng.abort("a")
    eng.abort("w")
    m = eng.metrics()
    assert (m.num_running, m.num_waiting, m.num_paused, m.kv_usage) == (0, 0, 0, 0)


def test_add_validation() -> None:
    eng = SimEngine(toy(kv_capacity_tokens=100))
    eng.add(spec("a", 10, 5))
    with pytest.raises(ValueError):
        eng.add(spec("a", 10, 5))
    with pytest.raises(ValueError):
        eng.add(spec("huge", 90, 20))
    with pytest.raises(ValueError):
        SimEngine(TOY, policy="lifo")  # type: ignore[arg-type]


def test_token_text_is_deterministic_words() -> None:
    def texts() -> str:
        eng = SimEngine(TOY)
        eng.add(spec("x", 4, 8))
        return "".join(t.text for r in run_all(eng) for t in r.tokens)

    a = texts()
    assert a == texts()
    assert len(a.split(" ")) == 8 and not a.startswith(" ")


# ---- fast path ---------------------------------------------------------------------------------

Trace = list[tuple[float, SeqSpec]]
Timeline = dict[tuple[str, str, int], float]


def drive_slow(eng: SimEngine, trace: Trace) -> Timeline:
    """Reference driver: one ``step()`` at a time, arrivals join at step boundaries."""
    times: Timeline = {}
    t, i = 0.0, 0
    while i < len(trace) or eng.has_work():
        while i < len(trace) and trace[i][0] <= t:
            eng.add(trace[i][1])
            i += 1
        if not eng.has_work():
            t = trace[i][0]
            continue
        r = eng.step()
        for e in r.evicted:
            times[("evict", e.seq_id, sum(k[0] == "evict" and k[1] == e.seq_id for k in times))] = t
        t += r.duration_s
        for tok in r.tokens:
            if tok.index == 0:
                times[("first", tok.seq_id, 0)] = t
        for f in r.finished:
            times[("finish", f.seq_id, f.completion_tokens)] = t
    return times


def drive_fast(eng: SimEngine, trace: Trace) -> tuple[Timeline, int]:
    times: Timeline = {}
    t, i, calls = 0.0, 0, 0
    while i < len(trace) or eng.has_work():
        while i < len(trace) and trace[i][0] <= t:
            eng.add(trace[i][1])
            i += 1
        until = trace[i][0] if i < len(trace) else math.inf
        if not eng.has_work():
            t = until
            continue
        adv = eng.advance(until, t)
        calls += 1
        assert adv.steps > 0
        t = adv.now
        for when, e in adv.events:
            if isinstance(e, EvictEvent):
                n = sum(k[0] == "evict" and k[1] == e.seq_id for k in times)
                times[("evict", e.seq_id, n)] = when
            elif isinstance(e, TokenEvent):
                assert e.index == 0
                times[("first", e.seq_id, 0)] = when
            else:
                times[("finish", e.seq_id, e.completion_tokens)] = when
    return times, calls


def assert_same(slow: Timeline, fast: Timeline) -> None:
    assert slow.keys() == fast.keys()
    for k, v in slow.items():
        assert fast[k] == pytest.approx(v, rel=1e-9, abs=1e-9), k


def make_trace(n: int, gap: float, prompts: list[int], outs: list[int], prios: list[int]) -> Trace:
    return [
        (
            i * gap + (i % 3) * 0.0037,
            spec(
                f"r{i}", prompts[i % len(prompts)], outs[i % len(outs)], prio=prios[i % len(prios)]
            ),
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_fast_path_equals_slow_path(policy: Policy) -> None:
    prof = toy(kv_capacity_tokens=600, max_num_seqs=6, max_num_batched_tokens=48)
    trace = make_trace(40, 0.35, [5, 60, 17, 130, 9], [40, 3, 90, 12, 1, 150], [3, 0, 7, 1])
    slow = drive_slow(SimEngine(prof, policy), trace)
    fast_eng = SimEngine(prof, policy)
    fast, calls = drive_fast(fast_eng, trace)
    assert_same(slow, fast)
    assert any(k[0] == "evict" for k in slow)  # the case exercises KV pressure
    m = fast_eng.metrics()
    assert m.steps_total > 2 * calls  # and the closed form actually skipped steps
    slow_eng = SimEngine(prof, policy)
    drive_slow(slow_eng, trace)
    ms = slow_eng.metrics()  # the closed form counts inter-token latency as the steps would
    assert m.itl_tokens_total == ms.itl_tokens_total > 0
    assert m.itl_s_total == pytest.approx(ms.itl_s_total, rel=1e-9)


def test_advance_single_seq_closed_form() -> None:
    eng = SimEngine(TOY)
    eng.add(spec("a", 10, 1000))
    adv = eng.advance(math.inf, 5.0)
    assert adv.steps == 1 and adv.now == pytest.approx(5.0 + 0.02)
    adv = eng.advance(math.inf, adv.now)
    assert adv.steps == 999
    # decode step j (ctx 11 + j) lasts 0.012 + 0.0001 * (11 + j); sum over j = 0..998
    expected = 999 * (0.012 + 0.0011) + 0.0001 * 998 * 999 / 2
    assert adv.now == pytest.approx(5.02 + expected)
    assert [type(e) for _, e in adv.events] == [FinishEvent]
    assert adv.events[0][0] == adv.now


def test_advance_stops_before_until() -> None:
    eng = SimEngine(TOY)
    eng.add(spec("a", 10, 1000))
    eng.advance(math.inf, 0.0)
    adv = eng.advance(1.0, 0.02)
    assert adv.now >= 1.0
    assert adv.now - (0.012 + 0.0001 * (10 + adv.steps)) < 1.0  # the last step started before
    assert eng.generated("a") == 1 + adv.steps


def test_advance_emit_all_tokens() -> None:
    eng = SimEngine(TOY)
    eng.add(spec("a", 10, 5))
    adv = eng.advance(math.inf, 0.0, emit_all_tokens=True)
    assert [e.index for _, e in adv.events if isinstance(e, TokenEvent)] == [0]
    adv = eng.advance(math.inf, adv.now, emit_all_tokens=True)
    assert [e.index for _, e in adv.events if isinstance(e, TokenEvent)] == [1, 2, 3, 4]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    policy=st.sampled_from(["fcfs", "priority"]),
    cap=st.integers(300, 3000),
    seqs=st.integers(1, 8),
    budget=st.integers(8, 200),
    reqs=st.lists(
        st.tuples(st.floats(0, 0.5), st.integers(1, 200), st.integers(1, 120), st.integers(0, 3)),
        min_size=1,
        max_size=25,
    ),
)
def test_fast_path_equals_slow_path_property(
    policy: Policy,
    cap: int,
    seqs: int,
    budget: int,
    reqs: list[tuple[float, int, int, int]],
) -> None:
    prof = toy(kv_capacity_tokens=cap, max_num_seqs=seqs, max_num_batched_tokens=budget)
    trace: Trace = []
    t = 0.0
    for i, (gap, prompt, out, prio) in enumerate(reqs):
        t += gap
        if prompt + out <= cap:
            trace.append((t, spec(f"r{i}", prompt, out, prio=prio)))
    slow = drive_slow(SimEngine(prof, policy), trace)
    fast, _ = drive_fast(SimEngine(prof, policy), trace)
    assert_same(slow, fast)
    assert sum(k[0] == "finish" for k in slow) == len(trace)


# ---- profiles ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", available_profiles())
def test_builtin_profiles_load_and_are_plausible(name: str) -> None:
    p = load_profile(name)
    assert 0.004 < p.step_fixed_s < 0.02  # a 7-8B decode step: weight streaming, ms scale
    assert p.prefill_s_per_token < p.step_fixed_s
    assert p.kv_capacity_tokens % 16 == 0


def test_default_alias_and_path(tmp_path: Path) -> None:
    assert load_profile("default") == load_profile("qwen2.5-7b-instruct-h100")
    f = tmp_path / "p.yaml"
    f.write_text(TOY.model_dump_json())  # JSON is YAML
    assert load_profile(f) == TOY
    with pytest.raises(ValueError):
        load_profile("no-such-profile")
    assert SimEngine().max_num_seqs == load_profile("default").max_num_seqs
