import pytest

from qosgate.config import TenantLimits
from qosgate.core.ratelimit import TenantLimiter, TokenBucket


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
