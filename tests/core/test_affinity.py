"""Cache-aware and session routing: the block index, sessions, the routers, the computed-token
charge, and the hot spot (one shared system prompt, many tenants) that the load release
spreads."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from qosgate.config import CacheRouting, Fleet, Tenant, default_config
from qosgate.core import AttemptFailed, Dispatch, QosInputs, ReplicaSpec, Scheduler, State
from qosgate.core.decisions import Decision
from qosgate.core.prefix import Prefix
from qosgate.core.routing.prefix_index import BlockLru, PrefixIndex
from qosgate.core.routing.sessions import Sessions
from qosgate.core.signals import LoadSignals
from tests.support.scheduler import Harness

BLOCK = 16


def _keys(*blocks: int, parent: int = 0) -> tuple[int, ...]:
    """Chained keys: each stands for its block and every block before it."""
    out = []
    for b in blocks:
        parent = hash((parent, b))
        out.append(parent)
    return tuple(out)


def _prefix(*blocks: int) -> Prefix:
    return Prefix(_keys(*blocks), BLOCK)


def _sched(router: str = "cache-aware", n: int = 2, window: int = 4, policy: str = "qos",
           **cache: object) -> Scheduler:
    cfg = default_config(
        tenants=tuple(Tenant(name=f"t{i}", api_keys=(f"k{i}",)) for i in range(8)),
        fleet=Fleet(router=router, cache=CacheRouting(**cache)))  # type: ignore[arg-type]
    return Scheduler(cfg, policy, [ReplicaSpec(f"r{i}", window, window_mode="fixed")
                                   for i in range(n)])


def _submit(s: Scheduler, rid: str, now: float, prefix: Prefix | None = None,
            cls: str = "api", session: str | None = None, prompt: int | None = None,
            key: str = "k0") -> list[Decision]:
    tokens = prompt if prompt is not None else (prefix.tokens + 4 if prefix else 100)
    req = s.make_request(rid, QosInputs(api_key=key, qos_class=cls), now, tokens, 50,
                         prefix=prefix, session=session)
    return s.submit(req, now)


def _where(ds: list[Decision]) -> dict[str, str]:
    return {d.req.id: d.replica for d in ds if isinstance(d, Dispatch)}


# ---------------------------------------------------------------- the index
def test_index_matches_the_leading_run_only() -> None:
    idx = PrefixIndex(capacity_tokens=1000 * BLOCK)
    idx.placed("a", _prefix(1, 2, 3))
    assert idx.match("a", _prefix(1, 2, 3, 4)) == 3
    assert idx.match("a", _prefix(1, 2, 9)) == 2
    assert idx.match("a", _prefix(9, 2, 3)) == 0  # same later blocks, other head: other keys
    assert idx.match("b", _prefix(1, 2, 3)) == 0


def test_index_evicts_least_recently_used_and_a_prompts_tail_first() -> None:
    lru = BlockLru(capacity=4)
    lru.touch(_keys(1, 2, 3))
    lru.touch(_keys(7, 8))  # one over: the first prompt's tail goes, its head stays
    assert lru.leading(_keys(1, 2, 3)) == 2
    assert lru.leading(_keys(7, 8)) == 2
    lru.touch(_keys(1, 2))  # used again: now the most recent
    lru.touch(_keys(5, 6))
    assert lru.leading(_keys(1, 2)) == 2 and lru.leading(_keys(7, 8)) == 0
    assert len(lru) == 4


def test_index_bound_is_the_replica_cache_in_blocks() -> None:
    idx = PrefixIndex(capacity_tokens=3 * BLOCK)
    idx.placed("a", _prefix(1, 2, 3, 4, 5))
    assert idx.blocks("a") == 3
    assert idx.match("a", _prefix(1, 2, 3)) == 3


def test_precise_replica_follows_its_engine_events_not_placements() -> None:
    idx = PrefixIndex(capacity_tokens=1000 * BLOCK)
    idx.follow_events("a")
    idx.observe("b", stored=_keys(1), removed=(), cleared=False)  # (learned: no events)
    assert idx.match("b", _prefix(1)) == 0
    idx.placed("a", _prefix(1, 2))
    assert idx.match("a", _prefix(1, 2)) == 0
    idx.observe("a", stored=_keys(1, 2), removed=(), cleared=False)
    assert idx.match("a", _prefix(1, 2, 3)) == 2
    idx.observe("a", stored=(), removed=_keys(1, 2)[1:], cleared=False)
    assert idx.match("a", _prefix(1, 2)) == 1
    idx.observe("a", stored=(), removed=(), cleared=True)
    assert idx.match("a", _prefix(1)) == 0


# ---------------------------------------------------------------- sessions
def test_sessions_expire_after_their_idle_timeout_and_drop_with_their_replica() -> None:
    s = Sessions(idle_s=10.0)
    s.bind("x", "a", 100, now=0.0)
    s.bind("y", "b", 50, now=5.0)
    binding = s.get("x", 9.0)
    assert binding is not None and binding.replica == "a"
    assert s.get("x", 10.0) is None  # idle 10 s
    assert s.get("y", 10.0) is not None
    s.drop_replica("b")
    assert s.get("y", 10.0) is None and len(s) == 0


# ---------------------------------------------------------------- cache-aware
def test_without_warm_replicas_cache_aware_places_exactly_as_least_load() -> None:
    """No prompt shares a block with one before it (and none has keys at all half the time):
    every placement is least-load's, decision for decision. (No realtime: a request pulled back
    for it would find its own prompt's blocks where it ran, and may wait for them.)"""
    runs = []
    for router in ("least-load", "cache-aware"):
        rng = random.Random(7)
        h = Harness(_sched(router, n=3, window=3), prefill_s=0.02, decode_s=0.002)
        for i in range(300):
            prefix = _prefix(10_000 + i, 1) if i % 2 else None
            h.submit(("api", "batch", "offline")[rng.randrange(3)],
                     f"k{rng.randrange(4)}", prompt=rng.randint(40, 900),
                     output=rng.randint(1, 200), prefix=prefix)
            h.run_until(h.now + rng.uniform(0.0, 0.05))
        h.run_until(h.now + 1000)
        runs.append([(d.req.id, d.replica) for d in h.dispatches])
    assert runs[0] == runs[1]


def test_a_conversation_turn_goes_where_its_prefix_is_cached() -> None:
    s = _sched()
    ds = _submit(s, "t1", 0.0, _prefix(1, 2, 3))
    first = _where(ds)["t1"]
    other = "r1" if first == "r0" else "r0"
    _submit(s, "x", 0.0, _prefix(50, 51))  # least-load alone would send the next one away
    assert _where(_submit(s, "t2", 0.0, _prefix(1, 2, 3, 4, 5)))["t2"] == first
    assert s.requests["t2"].cached_tokens == 3 * BLOCK
    assert _where(_submit(s, "y", 0.0, _prefix(60)))["y"] == other  # cold: least-load


def test_session_hint_without_block_keys() -> None:
    s = _sched()
    first = _where(_submit(s, "t1", 0.0, session="conv", prompt=400))["t1"]
    _submit(s, "x", 0.0, prompt=100)
    assert _where(_submit(s, "t2", 0.0, session="conv", prompt=500))["t2"] == first
    assert s.requests["t2"].cached_tokens == 400  # the last turn's prompt leads this one


def test_load_release_passes_over_a_busy_warm_replica() -> None:
    """With load weighing nothing in the cost (``decode_load_s`` 0), requests sharing a
    prefix would all go to the warm replica; the release sends the next one elsewhere once
    that replica's load passes the fleet's mean by the factor (plus the slack)."""
    s = _sched(n=3, window=8, decode_load_s=0.0)
    got = []
    for i in range(8):
        got.append(_where(_submit(s, f"t{i}", 0.0, _prefix(1, 2, 100 + i)))[f"t{i}"])
        s.first_token(f"t{i}", 0.0)  # (no prefill queued: only the load counts)
    warm = got[0]
    k = got.index(next(r for r in got if r != warm))
    assert 2 <= k < 8 and got[:k] == [warm] * k, got
    # the score at the release: (k + 1) / 8 past 1.5 x the mean + 0.25
    assert (k + 1) / 8 > 1.5 * ((k + 1) / 8 + 2 / 8) / 3 + 0.25 >= k / 8


def test_realtime_takes_a_warm_replica_only_where_its_budgets_hold() -> None:
    # prefill 1000 tokens/s: a 2000-token queue there is 2 s, past realtime's 1 s TTFT budget
    s = _sched(prefill_tokens_per_s=1000.0, release_slack=10.0, window=8)
    warm = _where(_submit(s, "w", 0.0, _prefix(1, 2), prompt=2000))["w"]
    assert _where(_submit(s, "rt", 0.0, _prefix(1, 2, 3), cls="realtime", prompt=60))["rt"] != warm
    # its TPOT: an engine whose time per token is past realtime's 200 ms
    s2 = _sched(release_slack=10.0, window=8, decode_load_s=0.0)
    warm = _where(_submit(s2, "w", 0.0, _prefix(1, 2)))["w"]
    rep = s2.replicas[warm]
    rep.itl_s = 0.5
    cold = _where(_submit(s2, "rt", 0.0, _prefix(1, 2, 3), cls="realtime"))["rt"]
    assert cold != warm
    rep.itl_s = 0.05  # now the other one is past it (and holds more of the prompt)
    s2.replicas[cold].itl_s = 0.5
    assert _where(_submit(s2, "rt2", 0.0, _prefix(1, 2, 3), cls="realtime"))["rt2"] == warm


def test_batch_waits_briefly_for_its_full_warm_replica_then_goes_anywhere() -> None:
    """batch (TTFT budget 30 s) may wait, no longer than warm_wait_s nor the prefill it saves;
    api (5 s, under ten times the bound) never waits."""
    s = _sched(window=1, prefill_tokens_per_s=1000.0, warm_wait_s=2.0)
    p = _prefix(*range(20))  # 320 tokens cached: 0.32 s of prefill saved
    warm = _where(_submit(s, "w", 0.0, p, cls="batch"))["w"]
    assert _submit(s, "b", 0.0, _prefix(*range(21)), cls="batch") == []  # held
    b = s.requests["b"]
    assert s.router.holds(b, 0.1) and b.state is State.QUEUED
    wake = s.next_timer()
    assert wake is not None and wake == pytest.approx(0.32)
    ds = s.tick(0.32)
    assert _where(ds) == {"b": "r1" if warm == "r0" else "r0"}
    assert not s.router.holds(b, 0.32)
    # api does not wait: it goes to the cold replica at once
    s2 = _sched(window=1, prefill_tokens_per_s=1000.0, warm_wait_s=2.0)
    _submit(s2, "w", 0.0, p, cls="api")
    assert "a" in _where(_submit(s2, "a", 0.0, _prefix(*range(21)), cls="api"))


def test_a_held_request_takes_its_warm_replica_when_that_frees_a_slot() -> None:
    s = _sched(window=1, prefill_tokens_per_s=1000.0, warm_wait_s=2.0)
    p = _prefix(*range(20))
    warm = _where(_submit(s, "w", 0.0, p, cls="batch"))["w"]
    _submit(s, "b", 0.0, _prefix(*range(21)), cls="batch")
    s.first_token("w", 0.1)
    assert _where(s.complete("w", 0.2, 5)) == {"b": warm}


def test_a_replica_that_goes_down_or_restarts_loses_its_cache() -> None:
    s = _sched()
    warm = _where(_submit(s, "w", 0.0, _prefix(1, 2)))["w"]
    idx = s.router.index  # type: ignore[attr-defined]
    assert idx.match(warm, _prefix(1, 2)) == 2
    s.observe(warm, 1.0, up=False)
    assert idx.match(warm, _prefix(1, 2)) == 0
    s.observe(warm, 2.0, up=True)
    s.first_token("w", 2.0)
    s.complete("w", 2.1, 5)
    _submit(s, "w2", 3.0, _prefix(1, 2))
    where = s.requests["w2"].replica or ""
    sig = LoadSignals(at=3.0, preemptions_total=5, itl_seconds_total=1.0, itl_tokens_total=50)
    s.observe(where, 3.0, signals=sig)
    assert idx.match(where, _prefix(1, 2)) == 2
    # the same replica's counters start over: a new engine answers, with an empty cache
    sig = LoadSignals(at=4.0, preemptions_total=0, itl_seconds_total=0.1, itl_tokens_total=3)
    s.observe(where, 4.0, signals=sig)
    assert idx.match(where, _prefix(1, 2)) == 0


def test_observe_cache_feeds_a_replica_that_publishes_kv_events() -> None:
    cfg = default_config(fleet=Fleet(router="cache-aware",
                                     cache=CacheRouting(decode_load_s=0.0)))
    s = Scheduler(cfg, "qos", [ReplicaSpec("r0", 4, window_mode="fixed", cache_events=True),
                               ReplicaSpec("r1", 4, window_mode="fixed")])
    s.observe_cache("r1", 0.0, stored=_keys(1, 2, 3))  # (r1 guesses: events change nothing)
    s.observe_cache("r0", 0.0, stored=_keys(1, 2, 3))
    _submit(s, "x", 0.0, prompt=10)  # r0 is now the more loaded
    assert _where(_submit(s, "t", 0.0, _prefix(1, 2, 3, 4)))["t"] == "r0"
    s.observe_cache("r0", 0.0, cleared=True)
    assert s.router.index.match("r0", _prefix(1, 2, 3)) == 0  # type: ignore[attr-defined]


# ---------------------------------------------------------------- the KV bound
def _kv_sched(**cache: object) -> Scheduler:
    """Two replicas whose KV holds 1000 prompt tokens: r0 runs an 800-token prompt, r1 two
    of 100 (least-load alone would send the next prompt to r0, the less loaded by its score)."""
    s = _sched(n=2, window=8, replica_cache_tokens=1000, **cache)
    assert _where(_submit(s, "big", 0.0, prompt=800)) == {"big": "r0"}
    assert _where(_submit(s, "s1", 0.0, prompt=100)) == {"s1": "r1"}
    assert _where(_submit(s, "s2", 0.0, prompt=100)) == {"s2": "r1"}
    return s


def test_a_replica_whose_kv_would_overflow_is_passed_over() -> None:
    unbound = _kv_sched(kv_fill=None)
    assert _where(_submit(unbound, "x", 0.0, prompt=300)) == {"x": "r0"}  # least-load's pick
    s = _kv_sched(kv_fill=0.9)  # r0: 800 + 300 past 900; r1: 200 + 300 within it
    assert _where(_submit(s, "x", 0.0, prompt=300)) == {"x": "r1"}
    assert not s.router.holds(s.requests["x"], 0.0)


def test_where_no_replica_has_kv_room_a_request_waits_in_the_queue_within_its_bound() -> None:
    s = _kv_sched(kv_fill=0.9, kv_wait_s=5.0)
    assert _submit(s, "b", 0.0, prompt=750, cls="batch") == []  # fits neither: held here
    b = s.requests["b"]
    assert b.state is State.QUEUED and s.router.holds(b, 0.0)
    assert s.next_timer() == pytest.approx(5.0)
    # realtime is never held: its engine priority is how it gets its TTFT
    rt = _where(_submit(s, "rt", 0.0, prompt=750, cls="realtime"))["rt"]
    s.first_token("rt", 0.5)
    assert _where(s.complete("rt", 0.5, 5)) == {}  # neither has room for it yet
    roomy = "r1" if rt == "r0" else "r0"
    done = "big" if roomy == "r0" else "s1"
    s.first_token(done, 1.0)
    assert _where(s.complete(done, 1.0, 5)) == {"b": roomy}  # room again: it goes there
    assert not s.router.holds(b, 1.0)
    # held past its bound, a request goes anyway
    s2 = _kv_sched(kv_fill=0.9, kv_wait_s=5.0)
    assert _submit(s2, "b", 0.0, prompt=750, cls="api") == []
    assert _where(s2.tick(5.0)) == {"b": "r0"}


# ---------------------------------------------------------------- session-affinity
def test_session_affinity_sticks_then_fails_over_and_rebinds() -> None:
    s = _sched("session-affinity", n=3)
    first = _where(_submit(s, "a1", 0.0, session="conv"))["a1"]
    _submit(s, "x", 0.0)
    _submit(s, "y", 0.0)
    assert _where(_submit(s, "a2", 0.1, session="conv"))["a2"] == first
    s.observe(first, 0.2, up=False)  # it dies: the next turn goes elsewhere, and stays there
    second = _where(_submit(s, "a3", 0.3, session="conv"))["a3"]
    assert second != first
    s.observe(first, 0.4, up=True)
    assert _where(_submit(s, "a4", 0.5, session="conv"))["a4"] == second


def test_session_affinity_forgets_an_idle_session() -> None:
    s = _sched("session-affinity", n=2, window=8, session_idle_s=5.0)
    first = _where(_submit(s, "a1", 0.0, session="conv"))["a1"]
    assert _where(_submit(s, "a2", 1.0, session="conv"))["a2"] == first  # (more loaded)
    assert _where(_submit(s, "a3", 6.0, session="conv"))["a3"] != first  # idle 5 s: least-load


# ---------------------------------------------------------------- the computed-token charge
def _charges(s: Scheduler) -> list[float]:
    seen: list[float] = []
    settle = s.policy.settle

    def watched(req: object, delta: float) -> None:
        seen.append(delta)
        settle(req, delta)  # type: ignore[arg-type]

    s.policy.settle = watched  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("engine_says", [None, 0, 3 * BLOCK])
def test_fair_share_is_charged_the_tokens_the_engine_computed(engine_says: int | None) -> None:
    """Charged at dispatch: the estimate (the whole prompt) less what the router expects
    cached; settled at completion with the engine's own count (None: the router's estimate
    stands)."""
    s = _sched()
    _submit(s, "w", 0.0, _prefix(1, 2, 3, 4))
    s.first_token("w", 0.1)
    s.complete("w", 0.2, 10)
    deltas = _charges(s)
    req = s.make_request("t", QosInputs(api_key="k0", qos_class="api"), 0.3, 4 * BLOCK + 4, 50,
                         prefix=_prefix(1, 2, 3, 4))
    charged = req.cost
    s.submit(req, 0.3)
    assert req.cached_tokens == 4 * BLOCK
    s.first_token("t", 0.4)
    s.complete("t", 0.5, 20, cached_tokens=engine_says)
    cached = 4 * BLOCK if engine_says is None else engine_says
    w = s.pricing
    assert charged + sum(deltas) == pytest.approx(
        w.prompt_weight * (4 * BLOCK + 4 - cached) + w.output_weight * 20)


def test_a_retried_request_is_charged_whole_until_placed_again() -> None:
    s = _sched(decode_load_s=0.0)
    _submit(s, "w", 0.0, _prefix(1, 2, 3, 4))
    s.first_token("w", 0.0)
    req = s.make_request("t", QosInputs(api_key="k0", qos_class="api"), 0.0, 4 * BLOCK + 4, 50,
                         prefix=_prefix(1, 2, 3, 4))
    full = req.cost
    s.submit(req, 0.0)
    assert req.cost == pytest.approx(full - s.pricing.prompt_weight * 4 * BLOCK)
    warm = req.replica
    s.attempt_failed("t", 0.1, AttemptFailed("upstream_500"))  # retried on the other, cold replica
    assert req.replica not in (None, warm) and req.cached_tokens == 0
    assert req.cost == pytest.approx(full)


# ---------------------------------------------------------------- the hot spot
@pytest.mark.slow
def test_hot_spot_one_system_prompt_many_tenants_spreads_and_stays_fair() -> None:
    """Every request of eight tenants starts with the same long system prompt: affinity alone
    would pile them all onto the replica that ran it first. The load release spreads them over
    the four replicas, and the tenants are served alike."""
    rng = random.Random(3)
    h = Harness(_sched(n=4, window=8), prefill_s=0.05, decode_s=0.004)
    system = list(range(40))
    for i in range(1600):
        t = i % 8
        h.submit("api", f"k{t}", prompt=(41 + 2) * BLOCK, output=rng.randint(20, 80),
                 prefix=_prefix(*system, 100_000 + i))
        if i % 8 == 7:
            h.run_until(h.now + 0.012)
    h.run_until(h.now + 1000)
    per_replica = Counter(d.replica for d in h.dispatches)
    assert len(per_replica) == 4
    assert min(per_replica.values()) >= 0.15 * sum(per_replica.values()), per_replica
    done = Counter(r.tenant for r in h.outcomes.values() if r.state is State.COMPLETED)
    assert len(done) == 8 and max(done.values()) - min(done.values()) <= 0.1 * max(done.values())
    # and the warm blocks did pay: most prompts were placed where the system prompt was held
    hits = sum(1 for d in h.dispatches if d.req.cached_tokens >= 40 * BLOCK)
    assert hits >= 0.9 * len(h.dispatches)


@pytest.mark.parametrize(("router", "reads"), [("cache-aware", True), ("session-affinity", False),
                                               ("least-load", False), ("most-free", False)])
def test_only_a_router_that_weighs_prefixes_asks_the_gateway_for_them(router: str,
                                                                      reads: bool) -> None:
    """The gateway hashes a prompt's blocks only when the router reads them (``reads_prefix``):
    under any other router it would be per-request work nobody uses."""
    assert _sched(router).reads_prefix is reads
