"""The simulated engine by hand: a toy profile with round numbers (durations computed by hand),
run to its end; sequences that share a prefix, in blocks of ``B`` tokens."""

from __future__ import annotations

from qosgate.core.prefix import Prefix
from qosgate.models.simmodel import EngineProfile, SimEngine
from qosgate.models.step import SeqSpec, StepResult

# Round numbers so that durations can be computed by hand.
TOY = EngineProfile(
    name="toy",
    model="toy",
    gpu="none",
    step_fixed_s=0.01,
    prefill_s_per_token=0.001,
    decode_s_per_ctx_token=0.0001,
    decode_s_per_seq=0.002,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    kv_capacity_tokens=10_000,
)


def toy(**update: int | float) -> EngineProfile:
    return TOY.model_copy(update=update)


def run_all(eng: SimEngine, limit: int = 100_000) -> list[StepResult]:
    out = []
    while eng.has_work():
        out.append(eng.step())
        assert len(out) < limit
    return out


B = 4  # tokens per block in these tests


def pspec(sid: str, keys: tuple[int, ...], prompt: int, out: int = 1) -> SeqSpec:
    return SeqSpec(sid, prompt, 1000, target_output_tokens=out, prefix=Prefix(keys, B))
