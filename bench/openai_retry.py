"""When the openai Python client sends a refused request again: a copy of its rule, so that a
bench's retries land when the SDK's would.

The rule, as ``openai._base_client.BaseClient._calculate_retry_timeout`` and ``_should_retry``
write it (openai 3.x):

- the delay the server asks for is read from ``retry-after-ms`` (milliseconds) if present,
  else from ``retry-after`` (seconds, a float, or an HTTP date);
- a delay in (0, 120] s is waited exactly, no jitter: every client refused in the same second
  with the same ``Retry-After`` comes back in the same second;
- a delay over 120 s means no retry at all (the refusal is the answer);
- a missing, zero, negative or unreadable one falls back to exponential backoff,
  0.5 s x 2^(retries already taken), at most 8 s, less a random 0-25 %.
"""

from __future__ import annotations

import email.utils
import math
import random
import time

INITIAL_DELAY_S = 0.5
MAX_DELAY_S = 8.0
MAX_RETRY_AFTER_S = 120.0


def asked_delay(retry_after_ms: str | None, retry_after: str | None) -> float | None:
    """The delay the answer asks for, in seconds, or None when it asks for none readable."""
    for value, divisor in ((retry_after_ms, 1000.0), (retry_after, 1.0)):
        if value is None:
            continue
        try:
            delay = float(value)
        except ValueError:
            continue
        if delay == math.inf and value.strip().lower() not in ("inf", "+inf", "infinity",
                                                               "+infinity"):
            return MAX_RETRY_AFTER_S + 1  # an overflow: too long, not malformed
        return delay / divisor
    if retry_after is None:
        return None
    try:
        date = email.utils.parsedate_tz(retry_after)
        if date is None:
            return None
        return float(email.utils.mktime_tz(date) - time.time())
    except (TypeError, ValueError, OverflowError, OSError):
        return None


def retry_delay(asked: float | None, retries_taken: int, rng: random.Random) -> float | None:
    """Seconds to wait before the next attempt, or None when the client does not retry."""
    if asked is not None and math.isfinite(asked) and asked > MAX_RETRY_AFTER_S:
        return None
    if asked is not None and math.isfinite(asked) and 0 < asked <= MAX_RETRY_AFTER_S:
        return asked
    backoff = min(INITIAL_DELAY_S * 2.0 ** min(retries_taken, 1000), MAX_DELAY_S)
    return max(0.0, backoff * (1 - 0.25 * rng.random()))
