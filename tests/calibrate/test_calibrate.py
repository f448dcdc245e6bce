"""``qosgate calibrate``: the fit (pure), the measurements' arithmetic, the probe against the
stand-in's own engine model in virtual time (which must give its profile back). The command end
to end against a live stand-in: ``tests/e2e/test_calibrate.py``.

How close a probe of a *live* stand-in on a busy machine comes is a timing figure, so it is a
benchmark (``bench/calibrate_accuracy.py``), not an assertion here."""

from __future__ import annotations

import pytest

from qosgate.calibrate.engine import Timed
from qosgate.calibrate.fit import fit, tpot_observation, ttft_observation
from qosgate.calibrate.probe import (
    Capacity,
    Probe,
    decode_observation,
    default_plan,
    kv_capacity_from_metrics,
)
from qosgate.models.simmodel import EngineProfile, SimEngine, load_profile
from qosgate.models.step import SeqSpec
from tests.support.calibration import COEFS, PROFILE

ATTENTION = 3e-9  # s per (prefill token, token it attends to): a CPU's quadratic prefill


def _attending(name: str = PROFILE) -> EngineProfile:
    return load_profile(name).model_copy(update={"prefill_s_per_ctx_token": ATTENTION})


def _synthetic(overhead: float = 0.002) -> list:  # type: ignore[type-arg]
    p = _attending()
    obs = [ttft_observation(f"p{n}", -(-n // p.max_num_batched_tokens) * p.step_fixed_s
                            + p.prefill_s_per_token * n + ATTENTION * n * (n + 1) / 2
                            + overhead, n, p.max_num_batched_tokens)
           for n in (16, 256, 2048, 5000)]
    for n in (1, 4, 16):
        for ln in (32, 1024):
            ctx = n * (ln + 20)
            obs.append(tpot_observation(f"d{n}", p.step_fixed_s + p.decode_s_per_ctx_token * ctx
                                        + p.decode_s_per_seq * n, ctx, n))
    return obs


def test_fit_recovers_exact_coefficients_and_the_overhead() -> None:
    p = _attending()
    f = fit(_synthetic())
    for c in COEFS:
        assert f.coef[c] == pytest.approx(getattr(p, c), rel=1e-9)
    assert f.coef["overhead_s"] == pytest.approx(0.002, rel=1e-9)
    assert max(abs(e) for e in f.errors()) < 1e-9


def test_a_negative_coefficient_is_pinned_to_zero_and_an_absent_one_unidentified() -> None:
    # decode steps that get *faster* with context: the per-ctx cost would be negative
    obs = [tpot_observation("a", 0.010, 100, 1), tpot_observation("b", 0.0099, 10_000, 1),
           tpot_observation("c", 0.012, 100, 10), ttft_observation("t", 0.05, 400, 2048)]
    f = fit(obs)
    assert f.coef["decode_s_per_ctx_token"] == 0.0
    assert all(v >= 0 for v in f.coef.values())
    only_decode = fit([tpot_observation("a", 0.01, 100, 1), tpot_observation("b", 0.02, 900, 1)])
    assert "prefill_s_per_token" in only_decode.unidentified
    assert "overhead_s" in only_decode.unidentified


def test_a_lone_prefill_costs_what_its_ttft_row_says_whatever_the_chunks() -> None:
    """The engine model's prefill of one prompt, in chunks of the batch budget, takes the time
    the fit's TTFT row gives it: each chunk attends to what came before it."""
    p = _attending().model_copy(update={"max_num_batched_tokens": 512})
    eng = SimEngine(p)
    eng.add(SeqSpec(seq_id="s", prompt_tokens=1300, max_tokens=1))
    t = 0.0
    while eng.has_work():
        t += eng.step().duration_s
    row = ttft_observation("p", 1.0, 1300, 512)
    modelled = sum(c * getattr(p, k) for c, k in zip(row.row(), COEFS, strict=False))
    assert t == pytest.approx(modelled, rel=1e-12)
    assert row.steps == 3 and row.prefill_pairs == 1300 * 1301 / 2


def test_the_decode_window_is_the_simulated_engines_step() -> None:
    """Token times from the engine model itself (3 seqs, staggered starts): the window's mean
    gap and summed context are what the step formula gives for that batch."""
    p = load_profile(PROFILE)
    eng = SimEngine(p)
    for i in range(3):
        eng.add(SeqSpec(seq_id=f"s{i}", prompt_tokens=100 + 50 * i, max_tokens=40))
    runs = {f"s{i}": Timed(sent=0.0) for i in range(3)}
    now = 0.0
    while eng.has_work():
        res = eng.step()
        now += res.duration_s
        for t in res.tokens:
            runs[t.seq_id].tokens.append(now)
    for i, r in enumerate(runs.values()):
        r.prompt_tokens = 100 + 50 * i
    obs = decode_observation("d", list(runs.values()), 100)
    assert obs is not None and obs.seqs == 3
    modelled = p.step_fixed_s + p.decode_s_per_ctx_token * obs.ctx_tokens + p.decode_s_per_seq * 3
    assert obs.measured_s == pytest.approx(modelled, rel=1e-6)


def test_kv_capacity_from_vllm_cache_config_info() -> None:
    text = ('# TYPE vllm:cache_config_info gauge\n'
            'vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",'
            'num_gpu_blocks="3640",prefix_caching_hash_algo="sha256"} 1.0\n'
            'vllm:num_requests_running{engine="0",model_name="m"} 0.0\n')
    assert kv_capacity_from_metrics(text) == 3640 * 16
    assert kv_capacity_from_metrics("vllm:num_requests_running 0\n") is None


class VirtualEngine:
    """The stand-in's engine model (``SimEngine`` of a profile) stepped in virtual time: what a
    stand-in at time scale 1 serves, timed with no machine in between."""

    def __init__(self, profile: EngineProfile) -> None:
        self.engine = SimEngine(profile)
        self.t = 0.0
        self.seqs = 0

    def now(self) -> float:
        return self.t

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[Timed]:
        runs: dict[str, Timed] = {}
        for ids in prompts:
            self.seqs += 1
            sid = f"s{self.seqs}"
            runs[sid] = Timed(sent=self.t, prompt_tokens=len(ids), completion_tokens=max_tokens)
            self.engine.add(SeqSpec(seq_id=sid, prompt_tokens=len(ids), max_tokens=max_tokens))
        while self.engine.has_work():
            res = self.engine.step()
            self.t += res.duration_s
            for tok in res.tokens:
                runs[tok.seq_id].tokens.append(self.t)
        return list(runs.values())


def test_the_probe_recovers_the_engines_profile_in_virtual_time() -> None:
    """The whole probe (plan, pilot, prefill ladder, decode windows, time guard) and the fit,
    against the engine model the stand-in serves: every coefficient comes back (no timing
    noise: the clock is virtual), and no run is skipped for time that fits the limit."""
    p = load_profile(PROFILE)
    cap = Capacity(p.max_num_seqs, p.max_num_batched_tokens, p.kv_capacity_tokens)
    engine = VirtualEngine(p)
    probe = Probe(engine, cap, default_plan(cap, None, 60.0), say=lambda _: None)
    result = fit(probe.run())
    assert probe.skipped == [], probe.skipped
    for c in COEFS:
        assert result.coef[c] == pytest.approx(getattr(p, c), rel=1e-6, abs=1e-12), c
    assert engine.t < 60.0  # the plan kept to its time limit, on the clock it was given


def test_a_run_that_would_pass_the_time_limit_is_skipped_and_said() -> None:
    p = load_profile(PROFILE)
    cap = Capacity(p.max_num_seqs, p.max_num_batched_tokens, p.kv_capacity_tokens)
    engine = VirtualEngine(p)
    probe = Probe(engine, cap, default_plan(cap, None, 8.0), say=lambda _: None)
    probe.run()
    assert probe.skipped and all(s.endswith("(time)") for s in probe.skipped), probe.skipped
    assert "decode n=64 prompt 1024 (time)" in probe.skipped
    assert engine.t < 8.0






