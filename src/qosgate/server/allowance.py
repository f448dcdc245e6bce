"""A tenant's allowance told to its client: OpenAI's ``x-ratelimit-*`` headers and the status view.

OpenAI sends ``x-ratelimit-{limit,remaining,reset}-{requests,tokens}`` on its responses, and the
openai client and LiteLLM read them to pace a caller; the gateway sends the same for the limits a
tenant has (a limit not configured has no headers). The values are the core's ``Allowance``; only
their spelling is here. A reset is a duration as OpenAI writes it (``20ms``, ``1s``, ``8.64s``,
``6m0s``, ``1h0m0s``), rounded up to the millisecond so that a client waiting that long finds the
bucket full.
"""

from __future__ import annotations

import math
from typing import Any

from qosgate.core.ratelimit import Allowance, Quota
from qosgate.wire.sse import Headers

_MS_PER_HOUR = 3_600_000
_MS_PER_MINUTE = 60_000


def duration(seconds: float) -> str:
    """``seconds`` as OpenAI's reset headers write a duration (Go's ``time.Duration`` style)."""
    ms = max(0, math.ceil(seconds * 1000 - 1e-6))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, _MS_PER_HOUR)
    minutes, rest = divmod(rest, _MS_PER_MINUTE)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    if minutes:
        return f"{minutes}m{secs}"
    return secs


def allowance_headers(allowance: Allowance) -> Headers:
    """The ``x-ratelimit-*`` headers of the limits configured (none when nothing is limited)."""
    headers: Headers = []
    for unit, q in (("requests", allowance.requests), ("tokens", allowance.tokens)):
        if q is not None:
            headers += [
                (f"x-ratelimit-limit-{unit}".encode(), str(q.limit).encode()),
                (f"x-ratelimit-remaining-{unit}".encode(), str(q.remaining).encode()),
                (f"x-ratelimit-reset-{unit}".encode(), duration(q.reset_s).encode()),
            ]
    return headers


def _quota_view(q: Quota) -> dict[str, Any]:
    return {"limit": q.limit, "remaining": q.remaining, "reset_s": round(q.reset_s, 3)}


def allowance_view(allowance: Allowance) -> dict[str, Any]:
    """The status view's ``allowance``: each configured limit, and the concurrency in use."""
    view: dict[str, Any] = {}
    if allowance.requests is not None:
        view["requests"] = _quota_view(allowance.requests)
    if allowance.tokens is not None:
        view["tokens"] = _quota_view(allowance.tokens)
    view["concurrent"] = {"in_use": allowance.concurrent, "max": allowance.max_concurrent}
    return view
