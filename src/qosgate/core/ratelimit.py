"""Per-tenant limits: token buckets for requests/min and tokens/min, and a concurrency count.

Buckets answer with an exact ``retry_after`` (the time until enough tokens have refilled), so a
client told "retry after 3 s" that comes back after 3 s is admitted. Token usage is charged as an
estimate at admission and corrected with the real usage at completion; a bucket may go into debt
when a request used more than estimated, which delays that tenant's next admission accordingly.

``Allowance`` is what a tenant is told of its limits (the gateway's ``x-ratelimit-*`` headers and
its status view): read from the buckets without touching them, so telling never changes them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qosgate.config import RateLimits

_EPSILON = 1e-9  # a refill that lands a hair under a whole token still counts it


@dataclass(frozen=True, slots=True)
class Quota:
    """One per-minute limit as a client sees it: its size, the whole units left now, and the
    seconds until the bucket is full again (its "reset": no memory of past use left)."""

    limit: int
    remaining: int
    reset_s: float


@dataclass(frozen=True, slots=True)
class Allowance:
    """A tenant's limits as it is told them; None where that limit is not configured."""

    requests: Quota | None
    tokens: Quota | None
    concurrent: int
    max_concurrent: int | None


class TokenBucket:
    __slots__ = ("capacity", "rate", "stamp", "tokens")

    def __init__(self, per_minute: float, now: float) -> None:
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.tokens = per_minute
        self.stamp = now

    def held(self, now: float) -> float:
        """The tokens in the bucket at ``now``, refilled in thought only (nothing changes)."""
        if now > self.stamp:
            return min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        return self.tokens

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = self.held(now)
            self.stamp = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` can be taken (0 if now). A request larger than the bucket
        waits for a full bucket rather than forever."""
        self._refill(now)
        need = min(amount, self.capacity)
        if self.tokens >= need:
            return 0.0
        return (need - self.tokens) / self.rate

    def take(self, amount: float) -> None:
        self.tokens -= amount

    def resize(self, per_minute: float) -> None:
        """A new limit: what the bucket holds is kept, up to the new size."""
        self.capacity = per_minute
        self.rate = per_minute / 60.0
        self.tokens = min(self.tokens, per_minute)

    def give_back(self, amount: float) -> None:
        self.tokens = min(self.capacity, self.tokens + amount)


def quota(bucket: TokenBucket, now: float) -> Quota:
    """What ``bucket`` holds at ``now`` (refilled in thought only: the bucket is not changed).
    A bucket in debt has nothing left, and its reset counts the debt's refill too."""
    held = bucket.held(now)
    return Quota(
        limit=math.floor(bucket.capacity + _EPSILON),
        remaining=max(0, math.floor(held + _EPSILON)),
        reset_s=max(0.0, (bucket.capacity - held) / bucket.rate),
    )


class TenantLimiter:
    """The limits of one tenant; ``check`` then ``admit`` so a refusal takes nothing."""

    __slots__ = ("concurrent", "max_concurrent", "rpm", "tpm")

    def __init__(self, limits: RateLimits, now: float) -> None:
        self.rpm = (
            TokenBucket(limits.requests_per_minute, now) if limits.requests_per_minute else None
        )
        self.tpm = TokenBucket(limits.tokens_per_minute, now) if limits.tokens_per_minute else None
        self.max_concurrent = limits.max_concurrent
        self.concurrent = 0

    def retune(self, limits: RateLimits, now: float) -> None:
        """New limits (a reload) for the requests admitted from now; those admitted keep their
        slots and charges (a bucket keeps what it holds, up to its new size)."""
        self.rpm = _resized(self.rpm, limits.requests_per_minute, now)
        self.tpm = _resized(self.tpm, limits.tokens_per_minute, now)
        self.max_concurrent = limits.max_concurrent

    def check(self, tokens: int, now: float) -> tuple[str, float] | None:
        """None if admissible, else (reason, retry_after seconds)."""
        if self.max_concurrent is not None and self.concurrent >= self.max_concurrent:
            return "concurrency_limit", 0.0  # unknown: frees when one finishes; caller estimates
        if self.rpm is not None:
            wait = self.rpm.wait_for(1, now)
            if wait > 0:
                return "rate_limit_requests", wait
        if self.tpm is not None:
            wait = self.tpm.wait_for(tokens, now)
            if wait > 0:
                return "rate_limit_tokens", wait
        return None

    def admit(self, tokens: int, rid: str = "") -> None:
        self.concurrent += 1
        if self.rpm is not None:
            self.rpm.take(1)
        if self.tpm is not None:
            self.tpm.take(tokens)

    def allowance(self, now: float) -> Allowance:
        return Allowance(
            requests=None if self.rpm is None else quota(self.rpm, now),
            tokens=None if self.tpm is None else quota(self.tpm, now),
            concurrent=self.concurrent,
            max_concurrent=self.max_concurrent,
        )

    def release(self, charged_tokens: int, used_tokens: int, rid: str = "") -> None:
        """A request ended: free its concurrency slot and correct the token estimate."""
        self.concurrent -= 1
        if self.tpm is not None and used_tokens != charged_tokens:
            if used_tokens < charged_tokens:
                self.tpm.give_back(charged_tokens - used_tokens)
            else:
                self.tpm.take(used_tokens - charged_tokens)


def _resized(bucket: TokenBucket | None, per_minute: float | None, now: float
             ) -> TokenBucket | None:
    if not per_minute:
        return None
    if bucket is None:
        return TokenBucket(per_minute, now)
    bucket._refill(now)
    bucket.resize(per_minute)
    return bucket
