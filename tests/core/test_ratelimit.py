import pytest

from qosgate.config import TenantLimits
from qosgate.core.ledger import LeasedLedger
from qosgate.core.ratelimit import Quota, TenantLimiter, TokenBucket, quota


def test_bucket_retry_after_is_exact() -> None:
    b = TokenBucket(per_minute=60, now=0.0)  # 1 token/s, burst 60
    for _ in range(60):
        assert b.wait_for(1, 0.0) == 0
        b.take(1)
    assert b.wait_for(1, 0.0) == pytest.approx(1.0)
    assert b.wait_for(1, 0.25) == pytest.approx(0.75)
    assert b.wait_for(1, 1.0) == 0  # coming back when told works


def test_tokens_estimate_is_corrected_on_completion() -> None:
    lim = TenantLimiter(TenantLimits(tokens_per_minute=600), now=0.0)  # 10 tokens/s
    assert lim.check(500, 0.0) is None
    lim.admit(500)
    assert lim.check(500, 0.0) == ("rate_limit_tokens", pytest.approx(40.0))
    lim.release(charged_tokens=500, used_tokens=100)  # used far less than estimated
    assert lim.check(500, 0.0) is None
    assert lim.concurrent == 0


def test_debt_when_usage_exceeds_the_estimate() -> None:
    lim = TenantLimiter(TenantLimits(tokens_per_minute=600), now=0.0)
    lim.admit(100)
    lim.release(charged_tokens=100, used_tokens=700)  # 100 tokens into debt
    reason, wait = lim.check(1, 0.0) or ("", 0.0)
    assert reason == "rate_limit_tokens" and wait == pytest.approx(10.1)


def test_concurrency_limit() -> None:
    lim = TenantLimiter(TenantLimits(max_concurrent=2), now=0.0)
    lim.admit(1)
    lim.admit(1)
    assert lim.check(1, 0.0) is not None and lim.check(1, 0.0)[0] == "concurrency_limit"  # type: ignore[index]
    lim.release(1, 1)
    assert lim.check(1, 0.0) is None


def test_allowance_reads_the_buckets_without_changing_them() -> None:
    lim = TenantLimiter(TenantLimits(requests_per_minute=60, tokens_per_minute=600,
                                     max_concurrent=4), now=0.0)
    lim.admit(300)
    lim.admit(300)  # requests: 58 left; tokens: empty, 10 tokens/s
    told = lim.allowance(0.5)
    assert told.requests == Quota(limit=60, remaining=58, reset_s=pytest.approx(1.5))
    assert told.tokens == Quota(limit=600, remaining=5, reset_s=pytest.approx(59.5))
    assert (told.concurrent, told.max_concurrent) == (2, 4)
    assert lim.allowance(0.5) == told  # telling took nothing and refilled nothing
    assert lim.rpm is not None and lim.rpm.stamp == 0.0


def test_allowance_of_a_full_bucket_resets_now_and_one_in_debt_has_nothing_left() -> None:
    bucket = TokenBucket(per_minute=600, now=0.0)
    assert quota(bucket, 5.0) == Quota(limit=600, remaining=600, reset_s=0.0)
    bucket.take(700)  # 100 tokens into debt
    assert quota(bucket, 0.0) == Quota(limit=600, remaining=0, reset_s=pytest.approx(70.0))
    assert quota(bucket, 20.0).remaining == 100


def test_allowance_names_only_the_limits_configured() -> None:
    told = TenantLimiter(TenantLimits(requests_per_minute=6), now=0.0).allowance(0.0)
    assert told.tokens is None and told.max_concurrent is None
    assert told.requests == Quota(limit=6, remaining=6, reset_s=0.0)


def test_a_shared_ledger_tells_this_instance_s_share() -> None:
    ledger = LeasedLedger()
    ledger.set_live(2)
    lim = ledger.limiter("acme", TenantLimits(requests_per_minute=60), now=0.0)
    lim.admit(10, "r1")
    told = lim.allowance(0.0)
    assert told.requests == Quota(limit=30, remaining=29, reset_s=pytest.approx(2.0))
    assert told.concurrent == 1


def test_retune_keeps_what_was_admitted_and_limits_what_comes() -> None:
    lim = TenantLimiter(TenantLimits(requests_per_minute=60, max_concurrent=4), 0.0)
    for i in range(3):
        assert lim.check(10, 0.0) is None
        lim.admit(10, f"r{i}")
    # lowered: the bucket keeps what it holds, up to the new size; the slots taken stay taken
    lim.retune(TenantLimits(requests_per_minute=1, max_concurrent=2, tokens_per_minute=100), 0.0)
    assert lim.concurrent == 3
    assert lim.check(10, 0.0) == ("concurrency_limit", 0.0)
    lim.release(10, 10)
    lim.release(10, 10)
    assert lim.check(10, 0.0) is None  # one a minute: the one it holds
    lim.admit(10)
    lim.release(10, 10)  # a slot free: the bucket is what refuses now
    reason, wait = lim.check(10, 0.0) or ("", 0.0)
    assert reason == "rate_limit_requests" and wait == pytest.approx(60.0)
    assert lim.tpm is not None and lim.tpm.capacity == 100  # a limit added: a full bucket
    lim.retune(TenantLimits(), 0.0)  # removed: no limit at all
    assert lim.rpm is None and lim.tpm is None and lim.max_concurrent is None
    assert lim.check(10, 0.0) is None


def test_a_leased_limiter_retunes_its_limits_and_its_shadow() -> None:
    ledger = LeasedLedger()
    lim = ledger.limiter("t", TenantLimits(requests_per_minute=600), 0.0)
    lim.retune(TenantLimits(requests_per_minute=6), 1.0)
    assert lim.limits.requests_per_minute == 6  # leased from the fleet at this from its next sync
    assert lim.shadow.rpm is not None and lim.shadow.rpm.capacity == 6
