"""The engine's host KV tier (vLLM's native CPU offloading): write-through, an LRU bounded by
``host_kv_tokens``, a host hit loaded at ``host_load_s_per_token`` after the GPU's own hit, the
last-token rule over both, vLLM's external counters, and nothing changed without a tier."""

from __future__ import annotations

import random

import pytest

from qosgate.models.prefix_cache import PrefixCache
from qosgate.models.simmodel import EngineMetrics, SimEngine, load_profile
from qosgate.models.step import FinishEvent, SeqSpec
from tests.support.simmodel import TOY, B, pspec, run_all, toy

LOAD = 0.0001  # s per token loaded from the host (prefill: 0.001)


def hosted(kv: int = 20, host: int = 1000) -> SimEngine:
    return SimEngine(toy(kv_capacity_tokens=kv, host_kv_tokens=host, host_load_s_per_token=LOAD))


def crowd_out(eng: SimEngine, prompt: int) -> None:
    """A request without a prefix whose KV leaves the GPU cache at most ``kv - prompt``."""
    eng.add(SeqSpec(f"big{prompt}", prompt, 1000, target_output_tokens=2))
    run_all(eng)


# ---- the host LRU (PrefixCache.touch) -----------------------------------------------------------

def test_touch_caches_head_warmest_and_skips_pinned_blocks() -> None:
    c = PrefixCache()
    c.pin((9,))
    c.touch((1, 2, 3, 9), B)  # 9 stays pinned; 3 is the coldest, 1 the warmest
    assert c.pinned == 1 and c.lru_tokens == 3 * B
    c.touch((3,), B)  # used again: now the warmest
    assert c.trim(B) == 2 and 3 in c and 1 not in c and 2 not in c


# ---- in the engine ------------------------------------------------------------------------------

def test_blocks_the_gpu_evicted_are_loaded_from_the_host() -> None:
    eng = hosted()
    eng.add(pspec("a", (1, 2, 3, 4), 16))
    run_all(eng)
    crowd_out(eng, 18)  # the GPU cache keeps <= 2 tokens: all four blocks go
    eng.add(pspec("b", (1, 2, 3, 4, 5), 17))
    r = eng.step()
    # 16 tokens loaded from the host, 1 computed
    assert r.duration_s == pytest.approx(0.01 + 1 * 0.001 + 16 * LOAD)
    assert r.finished == [FinishEvent("b", "stop", 17, 1, cached_tokens=16)]
    m = eng.metrics()
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (16 + 18 + 17, 0)
    # the connector is asked for what the GPU did not give: every prompt here, all of it
    assert (m.external_prefix_cache_queries_total, m.external_prefix_cache_hits_total) == (
        16 + 18 + 17, 16)
    assert m.prefill_tokens_total == 16 + 18 + 1


def test_gpu_run_first_then_the_host_run_after_it() -> None:
    eng = hosted(kv=24)
    eng.add(pspec("a", (1, 2, 3, 4), 16))
    run_all(eng)
    crowd_out(eng, 16)  # GPU cache bound 8: the tail blocks 4, 3 go, 1, 2 stay
    eng.add(pspec("b", (1, 2, 3, 4, 5), 20))
    r = eng.step()
    # 8 GPU-cached (free), 8 loaded from the host, 4 computed
    assert r.duration_s == pytest.approx(0.01 + 4 * 0.001 + 8 * LOAD)
    assert r.finished[0].cached_tokens == 16
    m = eng.metrics()
    assert m.prefix_cache_hits_total == 8 and m.external_prefix_cache_hits_total == 8
    assert m.external_prefix_cache_queries_total == 16 + 16 + (20 - 8)
    # loaded blocks are GPU-cached now: the same prompt again hits the GPU alone
    eng.add(pspec("c", (1, 2, 3, 4, 5), 20))
    assert eng.step().duration_s == pytest.approx(0.01 + 4 * 0.001)
    assert eng.metrics().prefix_cache_hits_total == 8 + 16


def test_last_prompt_token_is_computed_with_a_host_hit_too() -> None:
    eng = hosted()
    eng.add(pspec("a", (1, 2), 8))
    run_all(eng)
    crowd_out(eng, 18)
    eng.add(pspec("b", (1, 2), 8))  # both blocks in the host: the last one is recomputed
    r = eng.step()
    assert r.finished[0].cached_tokens == 4
    assert r.duration_s == pytest.approx(0.01 + 4 * 0.001 + 4 * LOAD)


def test_host_tier_is_an_lru_bounded_by_its_size() -> None:
    eng = hosted(host=2 * B)
    eng.add(pspec("a", (1, 2, 3, 4), 16))  # written through, only two blocks fit: the head
    run_all(eng)
    crowd_out(eng, 18)
    eng.add(pspec("b", (1, 2, 3, 4, 5), 17))
    r = eng.step()
    assert r.finished[0].cached_tokens == 2 * B
    assert r.duration_s == pytest.approx(0.01 + 9 * 0.001 + 8 * LOAD)
    # b's blocks were stored and made the warmest: a third prompt finds b's head, not a's tail
    crowd_out(eng, 18)
    eng.add(pspec("c", (1, 2, 3, 4, 5), 17))
    assert eng.step().finished[0].cached_tokens == 2 * B


def test_a_block_used_again_outlives_one_used_once() -> None:
    eng = hosted(host=4 * B)
    eng.add(pspec("a", (1, 2), 8))
    run_all(eng)
    eng.add(pspec("b", (3, 4), 8))
    run_all(eng)
    eng.add(pspec("a2", (1, 2, 7), 12))  # a's blocks used again (a GPU hit: stored again)
    run_all(eng)
    eng.add(pspec("d", (5, 6), 8))  # two more blocks: the two coldest go, b's
    run_all(eng)
    crowd_out(eng, 18)
    eng.add(pspec("a3", (1, 2, 9), 12))
    eng.add(pspec("b2", (3, 4, 8), 12))
    fins = {f.seq_id: f.cached_tokens for r in run_all(eng) for f in r.finished}
    assert fins == {"a3": 8, "b2": 0}


def test_a_tier_of_size_zero_changes_nothing() -> None:
    """``host_kv_tokens: 0`` (every built-in profile): the same times, events and counters as a
    profile without the tier's fields, whatever the load cost says."""
    chains = ((1, 2, 3, 4, 5), (1, 2, 6, 7, 8), (9, 10, 11, 12, 13))

    def run(prof_update: dict[str, float]) -> tuple[list[tuple[float, str, int]], EngineMetrics]:
        rng = random.Random(7)
        eng = SimEngine(toy(kv_capacity_tokens=120, max_num_batched_tokens=16, **prof_update))
        for i in range(40):
            keys = rng.choice(chains)[: rng.randrange(1, 6)]
            eng.add(pspec(f"s{i}", keys, rng.randrange(4, 24), out=rng.randrange(1, 9)))
        now, seen = 0.0, []
        while eng.has_work():
            adv = eng.advance(float("inf"), now)
            now = adv.now
            seen += [(round(t, 12), e.seq_id, e.cached_tokens)
                     for t, e in adv.events if isinstance(e, FinishEvent)]
        return seen, eng.metrics()

    plain = run({})
    assert run({"host_kv_tokens": 0, "host_load_s_per_token": 0.5}) == plain
    assert plain[1].external_prefix_cache_queries_total == 0


def test_a_host_tier_the_gpu_never_misses_changes_no_time() -> None:
    """A GPU cache that keeps everything: the host tier is never read, so every time and the
    GPU counters are the same; only the connector's queries (what the GPU missed) count."""
    def run(host: int) -> tuple[list[tuple[float, str, int]], int, int]:
        eng = SimEngine(toy(host_kv_tokens=host, host_load_s_per_token=LOAD))
        for i in range(8):
            eng.add(pspec(f"s{i}", (1, 2, 10 + i % 3), 12 + i, out=3))
        results = run_all(eng)
        fins = [(round(r.duration_s, 12), f.seq_id, f.cached_tokens)
                for r in results for f in r.finished]
        m = eng.metrics()
        return fins, m.prefix_cache_hits_total, m.external_prefix_cache_hits_total

    assert run(10_000)[:2] == run(0)[:2]
    assert run(10_000)[2] == 0


def test_built_in_profiles_load_cost_is_kv_bytes_over_pcie_and_far_below_prefill() -> None:
    for name, link_bytes_s in (("qwen2.5-7b-instruct-h100", 32e9), ("llama-3-8b-h100", 32e9),
                               ("qwen2.5-7b-instruct-a100", 16e9), ("llama-3-8b-a100", 16e9)):
        p = load_profile(name)
        assert p.host_kv_tokens == 0
        assert p.host_load_s_per_token == pytest.approx(
            p.kv_bytes_per_token / link_bytes_s, rel=0.01)
        assert p.host_load_s_per_token < p.prefill_s_per_token / 5
    assert TOY.host_kv_tokens == 0
