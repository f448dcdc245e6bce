"""The simulated engine with several models on one accelerator (each model's pass in turn), and
its engine time: each step's duration split between the seqs in it."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.models.simmodel import SimEngine
from qosgate.models.step import SeqSpec
from tests.support.simmodel import TOY, pspec, run_all, toy

# every time coefficient of TOY x 10
HEAVY = toy(step_fixed_s=0.1, prefill_s_per_token=0.01, decode_s_per_ctx_token=0.001,
            decode_s_per_seq=0.02)


def spec(sid: str, prompt: int, out: int, model: str = "") -> SeqSpec:
    return SeqSpec(sid, prompt, 1000, target_output_tokens=out, model=model)


def test_one_model_splits_the_fixed_cost_by_the_tokens_each_computes() -> None:
    eng = SimEngine(TOY, timed=True)
    eng.add(spec("a", 10, 3))
    eng.step()  # a prefills 10 tokens: the whole step is a's
    eng.add(spec("b", 5, 3))
    r2 = eng.step()  # a decodes (context 11, 1 token), b prefills 5: 6 tokens share 0.01
    assert r2.duration_s == pytest.approx(0.01 + 5 * 0.001 + 11 * 0.0001 + 0.002)
    time = eng.engine_time()
    assert time["a"] == pytest.approx((0.01 + 10 * 0.001, 0.01 / 6 + 11 * 0.0001 + 0.002))
    assert time["b"] == pytest.approx((0.01 * 5 / 6 + 5 * 0.001, 0.0))


def test_two_models_take_turns_in_one_step() -> None:
    eng = SimEngine(TOY, models={"heavy": HEAVY})
    eng.add(spec("light", 10, 2))
    eng.add(spec("big", 10, 2, model="heavy"))
    r1 = eng.step()  # both prefill 10: each model's pass, one after the other
    assert r1.duration_s == pytest.approx((0.01 + 10 * 0.001) + (0.1 + 10 * 0.01))
    r2 = eng.step()  # both decode with context 11
    assert r2.duration_s == pytest.approx((0.01 + 11 * 0.0001 + 0.002)
                                          + (0.1 + 11 * 0.001 + 0.02))
    time = eng.engine_time()
    assert time["light"] == pytest.approx((0.02, 0.01 + 11 * 0.0001 + 0.002))
    assert time["big"] == pytest.approx((0.2, 0.1 + 11 * 0.001 + 0.02))
    assert not eng.has_work()


def test_an_engine_not_timed_keeps_no_engine_time() -> None:
    eng = SimEngine(TOY)
    eng.add(spec("a", 10, 3))
    run_all(eng)
    assert eng.engine_time() == {}


def test_a_model_it_does_not_list_runs_on_its_own_profile() -> None:
    eng = SimEngine(TOY, models={"heavy": HEAVY})
    eng.add(spec("x", 10, 1, model="other"))
    assert eng.step().duration_s == pytest.approx(0.01 + 10 * 0.001)


def test_a_seq_added_again_after_an_abort_keeps_its_time() -> None:
    eng = SimEngine(TOY, timed=True)
    eng.add(spec("a", 10, 5))
    eng.step()
    eng.abort("a")
    eng.add(spec("a", 10, 1))
    eng.step()
    assert eng.engine_time()["a"][0] == pytest.approx(2 * (0.01 + 10 * 0.001))


SEQS = st.lists(
    st.tuples(st.integers(1, 120), st.integers(1, 40), st.sampled_from(["", "heavy", "x"])),
    min_size=1, max_size=12)


@settings(derandomize=True, max_examples=60, deadline=None)
@given(SEQS, st.booleans())
def test_engine_time_adds_up_to_the_busy_time_stepped_or_coalesced(
        seqs: list[tuple[int, int, str]], several: bool) -> None:
    """Stepping one by one and the closed-form stretches give every seq the same time, and the
    seqs' times add up to the engine's busy time (KV tight enough to evict)."""
    small = toy(max_num_seqs=3, max_num_batched_tokens=48, kv_capacity_tokens=400)
    models = {"heavy": HEAVY.model_copy(update={"max_num_seqs": 3})} if several else None
    stepped = SimEngine(small, models=models, timed=True)
    fast = SimEngine(small, models=models, timed=True)
    for eng in (stepped, fast):
        for i, (prompt, out, model) in enumerate(seqs):
            eng.add(spec(f"s{i}", prompt, out, model))
    run_all(stepped)
    now = 0.0
    while fast.has_work():
        now = fast.advance(math.inf, now).now
    for eng in (stepped, fast):
        total = sum(p + d for p, d in eng.engine_time().values())
        assert total == pytest.approx(eng.metrics().busy_s_total, rel=1e-9)
        if several:  # what it exports per model adds up to the same, and counts every token
            per_model = eng.metrics().model_time
            assert sum(t for _, t, _, _ in per_model) == pytest.approx(total, rel=1e-9)
            assert sum(o for _, _, _, o in per_model) == sum(out for _, out, _ in seqs)
    assert stepped.metrics().busy_s_total == pytest.approx(fast.metrics().busy_s_total)
    a, b = stepped.engine_time(), fast.engine_time()
    assert a.keys() == b.keys()
    for sid in a:
        assert a[sid] == pytest.approx(b[sid], rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("several", [False, True])
def test_a_host_tier_load_is_charged_to_the_seq_that_loads_it(several: bool) -> None:
    load = 0.0001
    hosted = toy(kv_capacity_tokens=20, host_kv_tokens=1000, host_load_s_per_token=load)
    models = {"heavy": HEAVY} if several else None
    eng = SimEngine(hosted, models=models, timed=True)
    eng.add(pspec("a", (1, 2, 3, 4), 16))
    run_all(eng)
    eng.add(SeqSpec("big", 18, 1000, target_output_tokens=2))  # crowds a's blocks out
    run_all(eng)
    eng.add(pspec("b", (1, 2, 3, 4, 5), 17))
    r = eng.step()  # 16 tokens loaded from the host, 1 computed: all of it b's
    assert r.duration_s == pytest.approx(0.01 + 1 * 0.001 + 16 * load)
    assert eng.engine_time()["b"] == pytest.approx((r.duration_s, 0.0))
    total = sum(p + d for p, d in eng.engine_time().values())
    assert total == pytest.approx(eng.metrics().busy_s_total)


def test_the_engine_exports_each_models_time_and_tokens_live_and_ended() -> None:
    eng = SimEngine(TOY, models={"heavy": HEAVY})
    eng.add(spec("light", 10, 2))
    eng.add(spec("big", 10, 5, model="heavy"))
    eng.step()
    eng.step()  # light has ended, big is still decoding
    got = {m: (t, p, o) for m, t, p, o in eng.metrics().model_time}
    time = eng.engine_time()
    assert got[""] == (pytest.approx(sum(time["light"])), 10, 2)
    assert got["heavy"] == (pytest.approx(sum(time["big"])), 10, 2)
    assert SimEngine(TOY).metrics().model_time == ()  # one model: nothing per model
