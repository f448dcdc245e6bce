"""A profile's time per prefill and decode token, and the model weights profiles give."""

from __future__ import annotations

from pathlib import Path

import pytest

from qosgate.config import ModelSpec
from qosgate.core.weights import ModelWeights
from qosgate.models.simmodel import EngineProfile, load_profile
from qosgate.models.token_times import (
    DECODE_BATCH,
    DECODE_CONTEXT,
    apply_profiles,
    profiled_weights,
    token_times,
)
from tests.support.simmodel import TOY, toy


def test_token_times_hand_computed() -> None:
    # TOY: a 64-token chunk, and a batch of 4 seqs (its max_num_seqs, under DECODE_BATCH)
    t = token_times(TOY)
    assert t.prefill_s == pytest.approx((0.01 + 0.001 * 64) / 64)
    assert t.decode_s == pytest.approx(0.01 / 4 + 0.002 + 0.0001 * DECODE_CONTEXT)


def test_decode_batch_is_the_representative_one_when_the_engine_runs_more() -> None:
    t = token_times(toy(max_num_seqs=1024))
    assert t.decode_s == pytest.approx(0.01 / DECODE_BATCH + 0.002 + 0.0001 * DECODE_CONTEXT)


def test_quadratic_prefill_term_counts_the_chunk_s_pairs() -> None:
    t = token_times(toy(prefill_s_per_ctx_token=1e-6))
    assert t.prefill_s == pytest.approx((0.01 + 0.001 * 64 + 1e-6 * 64 * 65 / 2) / 64)


def test_a_profile_every_time_of_which_is_tenfold_weighs_ten() -> None:
    heavy = toy(step_fixed_s=0.1, prefill_s_per_token=0.01, decode_s_per_ctx_token=0.001,
                decode_s_per_seq=0.02)
    profiles = {"toy": TOY, "heavy": heavy}

    def load(name: str | Path) -> EngineProfile:
        return profiles[str(name)]

    specs = (ModelSpec(name="light", profile="toy"), ModelSpec(name="big", profile="heavy"))
    got = profiled_weights(specs, None, load)
    assert got["light"] == (1.0, 1.0)
    assert got["big"] == pytest.approx((10.0, 10.0))
    weights = ModelWeights(specs)
    apply_profiles(weights, specs, None, load)
    w = weights.of("big")
    assert (w.prompt, w.output) == pytest.approx((10.0, 10.0))
    assert w.source == "profile"


def test_built_in_profiles_by_name_relative_to_the_reference() -> None:
    specs = (ModelSpec(name="a", profile="llama-3-8b-a100"),
             ModelSpec(name="b", profile="llama-3-8b-h100"))
    got = profiled_weights(specs, "b")
    a = token_times(load_profile("llama-3-8b-a100"))
    b = token_times(load_profile("llama-3-8b-h100"))
    assert got["b"] == (1.0, 1.0)
    assert got["a"] == pytest.approx((a.prefill_s / b.prefill_s, a.decode_s / b.decode_s))
    assert got["a"][1] > 1.0  # the A100 streams its weights slower: its decode costs more


def test_no_profiles_no_weights_and_a_reference_without_one_is_an_error() -> None:
    assert profiled_weights((ModelSpec(name="a"),), None) == {}
    specs = (ModelSpec(name="a"), ModelSpec(name="b", profile="llama-3-8b-h100"))
    with pytest.raises(ValueError, match="reference model 'a'"):
        profiled_weights(specs, None)


def test_an_adapter_needs_no_profile_of_its_own() -> None:
    specs = (ModelSpec(name="base", profile="llama-3-8b-h100"),
             ModelSpec(name="ad", base="base", profile="llama-3-8b-a100"))
    assert set(profiled_weights(specs, None)) == {"base"}
