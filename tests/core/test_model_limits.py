"""A tenant's limits on one model (``limits.models``, ``core.model_limits``): checked beside its
limits over all models, never refusing it on another model, released once, retuned on a reload,
an adapter counted against its base model's entry, and told to the client where they bind."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.config import ModelSpec, RateLimits, Tenant, TenantLimits, default_config
from qosgate.core import QosInputs, ReplicaSpec, Scheduler, State
from qosgate.core.ledger import LeasedLedger, LeasedLimiter
from qosgate.core.model_limits import limited_model, tighter
from qosgate.core.ratelimit import Allowance, Quota, TenantLimiter
from qosgate.core.shared import MemoryStore, SyncProtocol, prime, run_to_end, store_key

A, B = "model-a", "model-b"


def _tenant(limits: TenantLimits) -> Tenant:
    return Tenant(name="acme", api_keys=("k",), limits=limits)


def _sched(limits: TenantLimits, models: tuple[ModelSpec, ...] = (),
           ledger: LeasedLedger | None = None) -> Scheduler:
    cfg = default_config(tenants=[_tenant(limits)], models=models)
    return Scheduler(cfg, "qos", [ReplicaSpec("r0", 64, window_mode="fixed")], ledger=ledger)


def _submit(s: Scheduler, rid: str, model: str, now: float = 0.0, prompt: int = 10,
            max_tokens: int = 10) -> tuple[str, str, float | None]:
    req = s.make_request(rid, QosInputs(api_key="k"), now, prompt, max_tokens, model)
    s.submit(req, now)
    return req.state.value, req.reason, req.retry_after


def test_a_limit_on_one_model_refuses_it_there_and_not_on_another() -> None:
    s = _sched(TenantLimits(models={A: RateLimits(requests_per_minute=2)}))
    assert [_submit(s, f"a{i}", A)[0] for i in range(2)] == ["dispatched"] * 2
    state, reason, retry = _submit(s, "a2", A)
    assert (state, reason) == ("rejected", "model_rate_limit_requests")
    assert retry == pytest.approx(30.0)  # one request refills in 30 s at 2 a minute
    assert [_submit(s, f"b{i}", B)[0] for i in range(5)] == ["dispatched"] * 5


def test_the_tenant_s_limits_over_all_models_still_hold_on_top() -> None:
    s = _sched(TenantLimits(requests_per_minute=3, models={A: RateLimits(requests_per_minute=10)}))
    assert [_submit(s, f"r{i}", m)[0] for i, m in enumerate((A, B, A))] == ["dispatched"] * 3
    assert _submit(s, "r3", B)[:2] == ("rejected", "rate_limit_requests")
    assert _submit(s, "r4", A)[:2] == ("rejected", "rate_limit_requests")


def test_when_both_refuse_the_longer_wait_is_told() -> None:
    # tenant-wide: 2 a minute (30 s a request); on A: 1 a minute (60 s)
    s = _sched(TenantLimits(requests_per_minute=2,
                            models={A: RateLimits(requests_per_minute=1)}))
    assert [_submit(s, r, m)[0] for r, m in (("a0", A), ("b0", B))] == ["dispatched"] * 2
    assert _submit(s, "a1", A) == ("rejected", "model_rate_limit_requests", pytest.approx(60.0))
    s = _sched(TenantLimits(requests_per_minute=2,
                            models={A: RateLimits(requests_per_minute=6)}))
    _submit(s, "a0", A)
    _submit(s, "a1", A)  # the tenant's bucket is empty (30 s a request), A's has 4 (10 s each)
    assert _submit(s, "a2", A) == ("rejected", "rate_limit_requests", pytest.approx(30.0))


def test_a_model_s_concurrency_slot_is_freed_once_when_its_request_ends() -> None:
    s = _sched(TenantLimits(models={A: RateLimits(max_concurrent=1)}))
    assert _submit(s, "a0", A)[0] == "dispatched"
    assert _submit(s, "a1", A)[:2] == ("rejected", "model_concurrency_limit")
    s.complete("a0", 1.0, 5)
    s.complete("a0", 1.1, 5)  # a second end of the same request frees nothing more
    assert _submit(s, "a2", A, now=1.2)[0] == "dispatched"
    assert _submit(s, "a3", A, now=1.2)[:2] == ("rejected", "model_concurrency_limit")
    s.cancel("a2", 1.3)
    assert _submit(s, "a4", A, now=1.4)[0] == "dispatched"
    assert not s.model_limits.held.keys() - {"a4"}


def test_tokens_per_minute_on_a_model_is_settled_with_the_real_usage() -> None:
    s = _sched(TenantLimits(models={A: RateLimits(tokens_per_minute=600)}))  # 10 tokens/s
    assert _submit(s, "a0", A, prompt=100, max_tokens=400)[0] == "dispatched"
    assert _submit(s, "a1", A, prompt=100, max_tokens=400)[:2] == (
        "rejected", "model_rate_limit_tokens")
    s.complete("a0", 0.0, 10)  # used 110 of the 500 charged: the rest goes back
    assert _submit(s, "a2", A, prompt=100, max_tokens=300)[0] == "dispatched"


def test_an_adapter_counts_against_its_base_model_s_entry_unless_it_has_its_own() -> None:
    models = (ModelSpec(name=A), ModelSpec(name="a-lora", base=A),
              ModelSpec(name="a-own", base=A))
    s = _sched(TenantLimits(models={A: RateLimits(requests_per_minute=2),
                                    "a-own": RateLimits(requests_per_minute=1)}), models)
    assert [_submit(s, r, m)[0] for r, m in (("x0", A), ("x1", "a-lora"))] == ["dispatched"] * 2
    assert _submit(s, "x2", "a-lora")[:2] == ("rejected", "model_rate_limit_requests")
    assert _submit(s, "x3", "a-own")[0] == "dispatched"  # a bucket of its own
    assert limited_model({A: RateLimits()}, "a-lora", s.pricing.weights.base_of) == A
    assert limited_model({A: RateLimits()}, B, s.pricing.weights.base_of) is None


def test_a_reload_retunes_a_model_s_limit_and_lifts_one_removed() -> None:
    s = _sched(TenantLimits(models={A: RateLimits(max_concurrent=2)}))
    assert _submit(s, "a0", A)[0] == "dispatched"
    lowered = _tenant(TenantLimits(models={A: RateLimits(max_concurrent=1)}))
    s.retenant(default_config(tenants=[lowered]), 1.0)
    assert s.requests["a0"].state is State.DISPATCHED  # admitted before: keeps its slot
    assert _submit(s, "a1", A, now=1.0)[:2] == ("rejected", "model_concurrency_limit")
    s.retenant(default_config(tenants=[_tenant(TenantLimits())]), 2.0)
    assert _submit(s, "a2", A, now=2.0)[0] == "dispatched"
    s.complete("a0", 3.0, 5)  # its reservation, made before both reloads, is settled once
    on_a = s.model_limits.limiters[("acme", A)]
    assert isinstance(on_a, TenantLimiter) and on_a.concurrent == 0
    assert not s.model_limits.held  # a2 came with no limit on A to hold


def test_the_allowance_told_is_the_limit_that_binds_first() -> None:
    s = _sched(TenantLimits(requests_per_minute=100, tokens_per_minute=10_000,
                            models={A: RateLimits(requests_per_minute=3, max_concurrent=2)}))
    _submit(s, "a0", A)
    on_a = s.allowance("acme", 0.0, A)
    assert on_a.requests == Quota(limit=3, remaining=2, reset_s=pytest.approx(20.0))
    assert on_a.tokens is not None and on_a.tokens.limit == 10_000  # A has no token limit
    assert (on_a.concurrent, on_a.max_concurrent) == (1, 2)
    on_b = s.allowance("acme", 0.0, B)
    assert on_b == s.allowance("acme", 0.0)
    assert on_b.requests is not None and on_b.requests.limit == 100
    assert on_b.max_concurrent is None


def test_tighter_picks_per_limit_the_fewer_left() -> None:
    wide = Allowance(Quota(100, 5, 1.0), Quota(1000, 900, 6.0), 3, 10)
    narrow = Allowance(Quota(10, 8, 12.0), None, 1, 2)
    told = tighter(wide, narrow)
    assert told == Allowance(Quota(100, 5, 1.0), Quota(1000, 900, 6.0), 1, 2)


# ---------------------------------------------------------------- shared through a store
def test_a_model_s_limit_holds_across_instances_sharing_a_store() -> None:
    limits = TenantLimits(models={A: RateLimits(requests_per_minute=4)})
    store = MemoryStore()
    gateways = []
    for name in ("g1", "g2"):
        ledger = LeasedLedger()
        prime(ledger, [("acme", limits)], 0.0)
        gateways.append((_sched(limits, ledger=ledger), SyncProtocol(ledger, name)))
    for _ in range(2):  # the second sync sees both instances live
        for _, proto in gateways:
            run_to_end(proto.sync(), store, 0.0)
    served = []
    for i in range(6):
        sched, proto = gateways[i % 2]
        served.append(_submit(sched, f"a{i}", A)[0])
        run_to_end(proto.sync(), store, 0.0)
    assert served.count("dispatched") == 4  # the fleet's 4, not 4 on each instance
    assert [_submit(s, f"b{i}", B)[0] for i, (s, _) in enumerate(gateways)] == ["dispatched"] * 2


def test_a_tenant_s_key_and_its_model_keys_never_meet() -> None:
    wide = LeasedLimiter("acme", RateLimits(), 0.0)
    on_a = LeasedLimiter("acme", RateLimits(), 0.0, A)
    odd = LeasedLimiter('model:["acme", "model-a"]', RateLimits(), 0.0)
    keys = {store_key("rpm", lim) for lim in (wide, on_a, odd)}
    assert store_key("rpm", wide) == "rpm:acme"  # as every release keyed it
    assert len(keys) == 3


def test_a_failing_store_puts_the_limits_on_models_in_its_mode_too() -> None:
    for fail_open, reason in ((True, "model_rate_limit_requests"),
                              (False, "shared_state_unavailable")):
        limits = TenantLimits(models={A: RateLimits(requests_per_minute=2)})
        ledger = LeasedLedger()
        s = _sched(limits, ledger=ledger)
        proto = SyncProtocol(ledger, "g1", fail_open=fail_open, degrade_after=0.0)
        store = MemoryStore()
        _submit(s, "warm", B)
        store.down = True
        proto.sync_failed(0.0, "down")
        got = [_submit(s, f"a{i}", A, now=0.0)[:2] for i in range(3)]
        assert got[-1] == ("rejected", reason)
        assert _submit(s, "b1", B)[0] == "dispatched"


def test_a_limiter_primed_before_a_reload_has_the_reloaded_limits() -> None:
    ledger = LeasedLedger()
    prime(ledger, [("acme", TenantLimits(models={A: RateLimits(requests_per_minute=60)}))], 0.0)
    s = _sched(TenantLimits(models={A: RateLimits(requests_per_minute=60)}), ledger=ledger)
    s.retenant(default_config(tenants=[_tenant(
        TenantLimits(models={A: RateLimits(requests_per_minute=6)}))]), 1.0)
    _submit(s, "a0", A, now=1.0)
    assert ledger.model_limiters[("acme", A)].limits.requests_per_minute == 6


# ---------------------------------------------------------------- property
_EVENT = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from((A, B)), st.integers(1, 400)),
    st.tuples(st.just("end"), st.integers(0, 200), st.integers(0, 400)),
    st.tuples(st.just("wait"), st.floats(0.0, 5.0), st.just(0)),
)


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(limits=st.builds(RateLimits,
                        requests_per_minute=st.one_of(st.none(), st.floats(1, 30)),
                        tokens_per_minute=st.one_of(st.none(), st.floats(50, 3000)),
                        max_concurrent=st.one_of(st.none(), st.integers(1, 4))),
       events=st.lists(_EVENT, max_size=60))
def test_a_limit_on_model_a_never_refuses_a_request_on_model_b(
        limits: RateLimits, events: list[tuple[str, object, int]]) -> None:
    s = _sched(TenantLimits(models={A: limits}))
    now = 0.0
    running: list[str] = []
    for i, (kind, what, n) in enumerate(events):
        if kind == "submit":
            model = str(what)
            state, reason, _ = _submit(s, f"r{i}", model, now, prompt=n, max_tokens=n)
            if model == B:
                assert state != "rejected", reason
            elif state == "rejected":
                assert reason.startswith("model_"), reason
            else:
                running.append(f"r{i}")
        elif kind == "end" and running:
            s.complete(running.pop(int(str(what)) % len(running)), now, n)
        elif kind == "wait":
            now += float(str(what))
