"""The probe: what is sent to the engine, and the measurements (``fit.Observation``) it gives.

1. prefill: one request at a time on an idle engine, ``max_tokens`` 1, at a few prompt lengths up
   to the batch budget (each twice; the faster kept, a busy machine only ever adds time);
2. decode: n requests at once (n from 1 up to the engine's ``max_num_seqs``) at a short and a
   long prompt, each of ``tokens`` tokens with ``ignore_eos``; the mean gap between tokens while
   all n decode (after the last first token, before the first last token) is one decode step of
   n seqs whose contexts sum to the prompts plus the tokens each had at the window's middle.

Bounded in time: a first decode run gives the step time, which sets ``tokens`` so the plan fits
``time_limit_s``; a run that would pass the limit is skipped and said so.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from qosgate.calibrate.engine import (
    Engine,
    ProbeError,
    Timed,
    get_json,
    get_text,
    token_ids,
)
from qosgate.calibrate.fit import Observation, tpot_observation, ttft_observation


@dataclass(frozen=True, slots=True)
class Capacity:
    """The engine's limits the profile holds (and the probe respects)."""

    max_num_seqs: int
    max_num_batched_tokens: int
    kv_capacity_tokens: int


@dataclass(frozen=True, slots=True)
class Endpoint:
    """What the endpoint says of itself: its model, context length and KV capacity (tokens),
    each ``None`` where it does not say."""

    model: str | None
    max_model_len: int | None
    kv_capacity_tokens: int | None


_INFO = re.compile(r'^vllm:cache_config_info\{(?P<labels>[^}]*)\}', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def kv_capacity_from_metrics(text: str) -> int | None:
    """vLLM's ``vllm:cache_config_info`` labels: ``num_gpu_blocks`` x ``block_size`` (summed
    over its engines), or None when the exposition does not carry them."""
    total = 0
    for m in _INFO.finditer(text):
        labels = dict(_LABEL.findall(m.group("labels")))
        try:
            total += int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        except (KeyError, ValueError):
            continue
    return total or None


def describe(base: str) -> Endpoint:
    """``/v1/models`` (the first model, vLLM's ``max_model_len``) and ``/metrics``."""
    try:
        data = get_json(base, "/v1/models").get("data") or []
    except OSError as exc:
        raise ProbeError(f"{base}/v1/models: {exc}") from None
    first = data[0] if data else {}
    try:
        kv = kv_capacity_from_metrics(get_text(base, "/metrics"))
    except OSError:
        kv = None
    mml = first.get("max_model_len")
    return Endpoint(first.get("id"), int(mml) if mml else None, kv)


@dataclass
class Plan:
    """The probe's shape (defaults: about a minute against a fast engine)."""

    prefill_lengths: list[int]
    batch_sizes: list[int]
    decode_prompts: list[int]
    tokens: int = 64
    repeats: int = 2
    time_limit_s: float = 110.0


def default_plan(cap: Capacity, max_model_len: int | None, time_limit_s: float,
                 max_batch: int = 64) -> Plan:
    """Prompt lengths 16, 64, 256, ... up to the batch budget (and the context); batch sizes 1,
    4, 16, ... up to ``max_num_seqs`` (at most ``max_batch``)."""
    ctx = max_model_len or 32768
    top = min(cap.max_num_batched_tokens, ctx - 8, 8192)
    lengths = [n for n in (16, 64, 256, 1024, 4096) if n < 0.75 * top] + [top]
    sizes = [n for n in (1, 4, 16, 64) if n <= min(cap.max_num_seqs, max_batch)]
    if min(cap.max_num_seqs, max_batch) not in sizes:
        sizes.append(min(cap.max_num_seqs, max_batch))
    long = min(1024, ctx // 2, cap.max_num_batched_tokens)
    return Plan(lengths, sizes, sorted({32, long}), time_limit_s=time_limit_s)


@dataclass
class Probe:
    """Runs a ``Plan`` against an engine and collects the observations (``say`` reports each)."""

    engine: Engine
    cap: Capacity
    plan: Plan
    say: Callable[[str], None] = print
    seed: int = 0
    observations: list[Observation] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    _rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    def run(self) -> list[Observation]:
        deadline = self.engine.now() + self.plan.time_limit_s
        # a short lone decode first: the step time sets how many tokens the decode runs take
        pilot = self._decode(1, self.plan.decode_prompts[0], 16)
        step = pilot.measured_s if pilot else 0.05
        runs = len(self.plan.batch_sizes) * len(self.plan.decode_prompts)
        per_run = 0.6 * self.plan.time_limit_s / max(1, runs)
        self.plan.tokens = max(16, min(self.plan.tokens, int(per_run / max(step, 1e-4) / 2)))
        prefill_per_token = 0.0  # of the longest lone prefill: a decode run's prompts cost it
        for n in self.plan.prefill_lengths:
            best: Timed | None = None
            for _ in range(self.plan.repeats):
                if self.engine.now() > deadline:
                    break
                t = self._one(n, 1)
                if best is None or t.ttft < best.ttft:
                    best = t
            if best is None:
                self.skipped.append(f"prefill {n}")
                continue
            obs = ttft_observation(f"prefill {best.prompt_tokens or n}", best.ttft,
                                   best.prompt_tokens or n, self.cap.max_num_batched_tokens)
            self._keep(obs)
            prefill_per_token = best.ttft / (best.prompt_tokens or n)
        # a step of n seqs costs at most n / m times one of m <= n seqs (the step is a + b n
        # with a, b >= 0); the tightest such bound comes from the cheapest step per seq seen
        cheapest = (step, 1)
        for n in self.plan.batch_sizes:
            for p in self.plan.decode_prompts:
                label = f"decode n={n} prompt {p}"
                if n * (p + self.plan.tokens) > self.cap.kv_capacity_tokens:
                    self.skipped.append(f"{label} (KV)")
                    continue
                guess = (self.plan.tokens * cheapest[0] * max(1.0, n / cheapest[1])
                         + n * p * prefill_per_token) * 1.2
                if n > 1 and self.engine.now() + guess > deadline:
                    self.skipped.append(f"{label} (time)")
                    continue
                run = self._decode(n, p, self.plan.tokens)
                if run is None:
                    self.skipped.append(f"{label} (no window where all {n} decode)")
                else:
                    self._keep(run)
                    cheapest = min(cheapest, (run.measured_s, n), key=lambda x: x[0] / x[1])
        return self.observations

    def _keep(self, obs: Observation) -> None:
        self.observations.append(obs)
        self.say(f"  {obs.label:<28} {obs.measured_s * 1000:9.2f} ms")

    def _one(self, prompt: int, max_tokens: int) -> Timed:
        return self.engine.run([token_ids(prompt, self._rng)], max_tokens)[0]

    def _decode(self, n: int, prompt: int, tokens: int) -> Observation | None:
        """n requests sent at once; the mean step while all n decode (None: no such window)."""
        runs = self.engine.run([token_ids(prompt, self._rng) for _ in range(n)], tokens)
        return decode_observation(f"decode n={n} prompt {prompt}", runs, prompt)


def decode_observation(label: str, runs: list[Timed], prompt: int) -> Observation | None:
    """The window where every run decodes: from the last first token to the first last token.
    Its mean gap per run, averaged; the contexts summed at the window's middle."""
    t0 = max(r.tokens[0] for r in runs)
    t1 = min(r.tokens[-1] for r in runs)
    if t1 <= t0:
        return None
    gaps: list[float] = []
    ctx = 0.0
    mid = (t0 + t1) / 2
    for r in runs:
        idx = [i for i, t in enumerate(r.tokens) if t0 <= t <= t1]
        if len(idx) < 3:
            return None
        i, j = idx[0], idx[-1]
        gaps.append((r.tokens[j] - r.tokens[i]) / (j - i))
        # the step making token k attends to the prompt and k tokens; the steps from token i+1
        # to j average L + (i + j + 1) / 2, the index at the middle time (interpolated) + 1/2
        k = i + (mid - r.tokens[i]) / ((r.tokens[j] - r.tokens[i]) / (j - i))
        ctx += (r.prompt_tokens or prompt) + k + 0.5
    return tpot_observation(label, sum(gaps) / len(gaps), ctx, len(runs))
