"""The engine's prefix cache: the cache alone (pins, LRU, bound) and in ``SimEngine`` (prefill
cost, the last-token rule, metrics in tokens, eviction, KV accounting)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.models.prefix_cache import PrefixCache
from qosgate.models.simmodel import SimEngine
from qosgate.models.step import FinishEvent, SeqSpec
from tests.support.simmodel import TOY, B, pspec, run_all, toy

# ---- the cache alone ---------------------------------------------------------------------------

def test_lookup_is_the_longest_leading_run_and_respects_the_cap() -> None:
    c = PrefixCache()
    c.pin((1, 2, 3))
    assert c.lookup((1, 2, 3, 4), 10) == 3
    assert c.lookup((1, 9, 3), 10) == 1  # a gap ends the run, whatever follows
    assert c.lookup((9, 1, 2), 10) == 0
    assert c.lookup((1, 2, 3), 2) == 2


def test_pinned_blocks_are_never_evicted_and_unpinned_go_lru() -> None:
    c = PrefixCache()
    c.pin((1, 2))
    c.pin((1,))  # a second holder of block 1
    assert c.trim(0) == 0 and len(c) == 2  # nothing unpinned: nothing to evict
    c.unpin((1, 2), B)
    assert c.lru_tokens == B and 2 in c and c.pinned == 1  # 1 still held by the other
    c.unpin((1,), B)
    assert c.lru_tokens == 2 * B and c.pinned == 0


def test_lru_evicts_coldest_first_tail_before_head() -> None:
    c = PrefixCache()
    c.pin((1, 2, 3))
    c.unpin((1, 2, 3), B)  # released tail first: 3 is the coldest, 1 the warmest
    c.pin((7,))
    c.unpin((7,), B)  # released last: warmest of all
    assert c.trim(2 * B) == 2
    assert 3 not in c and 2 not in c and 1 in c and 7 in c
    assert c.lru_tokens == 2 * B


def test_a_hit_repins_and_moves_the_block_out_of_the_lru() -> None:
    c = PrefixCache()
    c.pin((1, 2))
    c.unpin((1, 2), B)
    c.pin((1,))  # taken again by a sequence: not evictable
    assert c.trim(0) == 1 and 1 in c and 2 not in c


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 12), max_size=5)), max_size=40),
       st.integers(0, 6))
def test_lru_tokens_match_the_unpinned_blocks(
    ops: list[tuple[bool, list[int]]], bound: int
) -> None:
    c = PrefixCache()
    held: list[tuple[int, ...]] = []
    for pin, keys in ops:
        if pin or not held:
            c.pin(tuple(keys))
            held.append(tuple(keys))
        else:
            c.unpin(held.pop(0), B)
        c.trim(bound * B)
        assert c.lru_tokens <= bound * B
        assert c.lru_tokens == B * (len(c) - c.pinned)


# ---- in the engine -----------------------------------------------------------------------------

def test_second_request_computes_only_uncached_tokens() -> None:
    eng = SimEngine(TOY)
    eng.add(pspec("a", (1, 2, 3), 12))  # 3 full blocks
    r = eng.step()
    assert r.duration_s == pytest.approx(0.01 + 12 * 0.001)
    assert not eng.has_work()
    eng.add(pspec("b", (1, 2, 5), 12))  # shares 2 blocks: 8 tokens cached, 4 computed
    r = eng.step()
    assert r.duration_s == pytest.approx(0.01 + 4 * 0.001)
    assert r.finished == [FinishEvent("b", "stop", 12, 1, cached_tokens=8)]
    m = eng.metrics()
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (24, 8)  # tokens
    assert m.prefill_tokens_total == 16


def test_last_prompt_token_is_always_computed() -> None:
    eng = SimEngine(TOY)
    eng.add(pspec("a", (1, 2), 8))
    run_all(eng)
    eng.add(pspec("b", (1, 2), 8))  # all cached: the last block is recomputed (vLLM's rule)
    r = eng.step()
    assert r.finished[0].cached_tokens == 4
    assert r.duration_s == pytest.approx(0.01 + 4 * 0.001)
    eng.add(pspec("c", (1, 2, 3), 9))  # 9 tokens: 2 full blocks hit, 1 token computed
    assert eng.step().finished[0].cached_tokens == 8


def test_a_partial_last_block_is_not_cached() -> None:
    eng = SimEngine(TOY)
    eng.add(pspec("a", (1, 2, 3), 10))  # block 3 holds 2 of 4 tokens
    run_all(eng)
    eng.add(pspec("b", (1, 2, 3, 4), 16))
    assert eng.step().finished[0].cached_tokens == 8


def test_cache_bounded_by_the_kv_running_seqs_do_not_hold() -> None:
    eng = SimEngine(toy(kv_capacity_tokens=40))
    eng.add(pspec("a", (1, 2, 3, 4), 16))
    run_all(eng)  # 16 tokens cached, unpinned
    eng.add(SeqSpec("big", 30, 1000, target_output_tokens=2))  # takes 30 of 40: LRU <= 10
    eng.step()
    eng.add(pspec("b", (1, 2, 3, 4), 16))
    fins = {f.seq_id: f for r in run_all(eng) for f in r.finished}
    # the two coldest blocks (3, 4: tail first) went; 1, 2 stayed
    assert fins["b"].cached_tokens == 8


def test_recompute_eviction_unpins_and_readmission_hits_again() -> None:
    # both fit at admission, not at full length: b is evicted, its prompt blocks stay cached
    def run(prefixed: bool) -> tuple[SimEngine, int]:
        eng = SimEngine(toy(kv_capacity_tokens=60))
        for sid, keys in (("a", (1, 2, 3)), ("b", (4, 5, 6))):
            spec = pspec(sid, keys, 12, out=25)
            eng.add(spec if prefixed else SeqSpec(sid, 12, 1000, target_output_tokens=25))
        results = run_all(eng)
        evicted = [e.seq_id for r in results for e in r.evicted]
        assert evicted[:1] == ["b"]
        return eng, len(evicted)

    eng, n = run(True)
    plain, n_plain = run(False)
    m = eng.metrics()
    # first admissions only count, as vLLM's: b's re-admission hit is not a query
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (24, 0)
    # the same schedule (cached tokens take KV too); each re-admission took b's 3 blocks
    assert n == n_plain
    assert plain.metrics().prefill_tokens_total - m.prefill_tokens_total == 12 * n
    assert m.kv_usage == 0


def test_shared_pinned_blocks_keep_kv_consistent() -> None:
    eng = SimEngine(TOY)
    eng.add(pspec("a", (1, 2), 8, out=5))
    eng.step()  # a prefilled, decoding, holding 1 and 2
    eng.add(pspec("b", (1, 2, 3), 12, out=5))  # shares pinned 1, 2 (counted in its own KV)
    eng.step()
    m = eng.metrics()
    assert m.kv_usage * TOY.kv_capacity_tokens == (8 + 1) + 12
    run_all(eng)
    assert eng.metrics().kv_usage == 0


def test_abort_releases_pins() -> None:
    eng = SimEngine(toy(kv_capacity_tokens=20))
    eng.add(pspec("a", (1, 2, 3, 4), 16, out=3))
    eng.step()
    eng.abort("a")
    assert eng.metrics().kv_usage == 0
    eng.add(pspec("b", (1, 2, 3, 4, 5), 17))
    assert eng.step().finished[0].cached_tokens == 16


def test_without_prefix_nothing_is_cached_but_queries_count() -> None:
    eng = SimEngine(TOY)
    eng.add(SeqSpec("a", 12, 10, target_output_tokens=1))
    eng.add(SeqSpec("b", 12, 10, target_output_tokens=1))
    fins = [f for r in run_all(eng) for f in r.finished]
    assert [f.cached_tokens for f in fins] == [0, 0]
    m = eng.metrics()
    assert (m.prefix_cache_queries_total, m.prefix_cache_hits_total) == (24, 0)
    assert m.prefill_tokens_total == 24


def test_advance_fast_path_matches_stepping_with_prefixes() -> None:
    def run(fast: bool) -> list[tuple[float, str, int]]:
        eng = SimEngine(toy(kv_capacity_tokens=200, max_num_batched_tokens=16))
        for i in range(6):
            eng.add(pspec(f"s{i}", (1, 2, 10 + i % 2, 20 + i), 16 + i, out=5 + 3 * i))
        now, seen = 0.0, []
        while eng.has_work():
            adv = eng.advance(float("inf"), now, emit_all_tokens=not fast)
            now = adv.now
            seen += [(round(t, 9), e.seq_id, getattr(e, "cached_tokens", -1))
                     for t, e in adv.events if isinstance(e, FinishEvent)]
        return seen

    assert run(True) == run(False)
