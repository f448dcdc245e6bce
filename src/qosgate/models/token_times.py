"""What one token of a model costs in accelerator time, read off its engine profile, and the
model weights that follow from it (``ModelSpec.profile``).

A model's weight is what one of its tokens costs in tokens of the reference model. Both profiles
give a step time as a fixed cost plus terms per token; a token's time depends on the batch it
shares that fixed cost with. So each is read at one *representative batch*, the same for every
model, and only their ratio is used:

- prefill: one chunk of ``max_num_batched_tokens`` prompt tokens starting at position 0 (the
  chunk a loaded engine runs; the step's fixed cost spread over a full chunk);
- decode: a batch of ``DECODE_BATCH`` sequences (fewer if the engine runs fewer at once), each
  attending to ``DECODE_CONTEXT`` tokens. A batch of one would price every model by its weight
  streaming alone (the fixed cost) and the largest batch by its matmuls alone; a loaded gateway
  runs between the two, where both count.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from qosgate.config import ModelSpec
from qosgate.core.weights import ModelWeights
from qosgate.models.simmodel import EngineProfile, load_profile

DECODE_BATCH = 64
DECODE_CONTEXT = 1024

ProfileLoader = Callable[[str | Path], EngineProfile]


@dataclass(frozen=True, slots=True)
class TokenTimes:
    """Seconds of accelerator time per prompt (prefill) token and per output (decode) token."""

    prefill_s: float
    decode_s: float


def token_times(profile: EngineProfile) -> TokenTimes:
    """``profile``'s time per prefill and per decode token at the representative batch."""
    chunk = profile.max_num_batched_tokens
    pairs = chunk * (chunk + 1) / 2  # (token, token it attends to) pairs of a chunk from 0
    prefill = (profile.step_fixed_s + profile.prefill_s_per_token * chunk
               + profile.prefill_s_per_ctx_token * pairs) / chunk
    batch = min(DECODE_BATCH, profile.max_num_seqs)
    decode = (profile.step_fixed_s / batch + profile.decode_s_per_seq
              + profile.decode_s_per_ctx_token * DECODE_CONTEXT)
    return TokenTimes(prefill, decode)


def profiled_weights(specs: Iterable[ModelSpec], reference: str | None,
                     load: ProfileLoader = load_profile) -> dict[str, tuple[float, float]]:
    """Each model with a ``profile``: its (prompt, output) weight, its token times over the
    reference model's. The reference needs a profile of its own; an adapter (``base``) takes
    its base's weight in ``ModelWeights``, so it needs none."""
    specs = tuple(specs)
    ref_name = reference if reference is not None else (specs[0].name if specs else "")
    profiled = {m.name: m.profile for m in specs if m.profile is not None and m.base is None}
    if not profiled:
        return {}
    ref_profile = profiled.get(ref_name)
    if ref_profile is None:
        raise ValueError(f"models: {sorted(profiled)} set a profile, but the reference model "
                         f"{ref_name!r} has none to weigh them against")
    ref = token_times(load(ref_profile))
    out: dict[str, tuple[float, float]] = {}
    for name, profile in profiled.items():
        mine = token_times(load(profile))
        out[name] = (mine.prefill_s / ref.prefill_s, mine.decode_s / ref.decode_s)
    return out


def apply_profiles(weights: ModelWeights, specs: Iterable[ModelSpec], reference: str | None,
                   load: ProfileLoader = load_profile) -> None:
    """Set ``weights``' profiled models (``ModelSpec.profile``) from their engine profiles."""
    for name, (prompt, output) in profiled_weights(specs, reference, load).items():
        weights.set_profiled(name, prompt, output)
