"""The spelling of a tenant's allowance: OpenAI's reset durations and the headers of the limits
a tenant has (none of a limit it has not)."""

from __future__ import annotations

import pytest

from qosgate.core.ratelimit import Allowance, Quota
from qosgate.server.allowance import allowance_headers, allowance_view, duration


@pytest.mark.parametrize(("seconds", "spelled"), [
    (0.0, "0s"),
    (0.0004, "1ms"),  # rounded up: a client waiting that long finds the bucket full
    (0.02, "20ms"),
    (0.999, "999ms"),
    (1.0, "1s"),
    (8.64, "8.64s"),
    (59.9991, "1m0s"),
    (360.0, "6m0s"),
    (61.5, "1m1.5s"),
    (3600.0, "1h0m0s"),
    (3723.25, "1h2m3.25s"),
])
def test_duration_is_written_as_openai_writes_it(seconds: float, spelled: str) -> None:
    assert duration(seconds) == spelled


def test_headers_of_the_limits_configured_only() -> None:
    told = Allowance(requests=Quota(limit=60, remaining=59, reset_s=1.0), tokens=None,
                     concurrent=1, max_concurrent=None)
    assert allowance_headers(told) == [
        (b"x-ratelimit-limit-requests", b"60"),
        (b"x-ratelimit-remaining-requests", b"59"),
        (b"x-ratelimit-reset-requests", b"1s"),
    ]
    assert allowance_headers(Allowance(None, None, 0, None)) == []
    assert allowance_view(told) == {
        "requests": {"limit": 60, "remaining": 59, "reset_s": 1.0},
        "concurrent": {"in_use": 1, "max": None},
    }
