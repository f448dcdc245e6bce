"""Who runs a job: a lease per job, with a fencing token.

The feeder asks ``acquire`` for each live job; the fence it gets is written with
``BatchStore.claim`` before any of the job's lines run, and every later write carries it, so a
stale owner (one whose lease passed to another while it was paused or cut off) has its writes
refused by the store (``Fenced``) rather than answering lines twice.

- ``LocalLease``: one gateway alone owns every live job; each start takes a fence above the one
  stored, so writes of an earlier run of the same directory can never land after ours.
- ``RedisLease`` (``redis.url``): several gateways sharing one batches directory. ``SET key owner
  NX PX ttl`` takes a job; the fence comes from an ``INCR`` kept above the stored one; renewal and
  release compare the owner before they touch the key, so one instance cannot renew or free a
  lease that has passed to another.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

__all__ = ["Lease", "LocalLease", "RedisLease"]


class Lease(Protocol):
    renew_every_s: float  # how often the feeder calls ``renew`` (inf: never needed)

    async def acquire(self, batch_id: str, stored_fence: int) -> int | None:
        """Take the job: its new fence (above ``stored_fence``), or None if another owns it."""
        ...

    async def renew(self, batch_id: str) -> bool:
        """Keep the job; False if it is no longer ours (the feeder drops it)."""
        ...

    async def release(self, batch_id: str) -> None:
        """Let the job go (it ended, or this gateway stops)."""
        ...

    async def close(self) -> None: ...


class LocalLease:
    """One gateway owns every job of its directory."""

    renew_every_s = float("inf")

    async def acquire(self, batch_id: str, stored_fence: int) -> int | None:
        return stored_fence + 1

    async def renew(self, batch_id: str) -> bool:
        return True

    async def release(self, batch_id: str) -> None:
        return None

    async def close(self) -> None:
        return None


# KEYS: lease, fence counter; ARGV: owner, ttl ms, stored fence. The fence (or nil: taken).
_ACQUIRE = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return nil end
local f = redis.call('INCR', KEYS[2])
local stored = tonumber(ARGV[3])
if f <= stored then f = stored + 1; redis.call('SET', KEYS[2], f) end
return f
"""
# KEYS: lease; ARGV: owner, ttl ms. 1 if renewed, 0 if it is no longer the owner's.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2]); return 1
end
return 0
"""
# KEYS: lease; ARGV: owner.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end
return 0
"""


class RedisLease:
    """Leases in Redis: ``owner`` names this instance (``redis.instance_id``)."""

    def __init__(self, url: str, owner: str, ttl_s: float, prefix: str = "qosgate:",
                 timeout_s: float = 1.0) -> None:
        import redis.asyncio as aioredis

        self.owner = owner
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.renew_every_s = ttl_s / 3
        self.prefix = prefix + "batch:"
        self._r: Any = aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            decode_responses=True)
        self._acquire = self._r.register_script(_ACQUIRE)
        self._renew = self._r.register_script(_RENEW)
        self._release = self._r.register_script(_RELEASE)

    async def acquire(self, batch_id: str, stored_fence: int) -> int | None:
        keys = [self.prefix + "lease:" + batch_id, self.prefix + "fence:" + batch_id]
        got = await self._acquire(keys=keys, args=[self.owner, self.ttl_ms, stored_fence])
        return None if got is None else int(got)

    async def renew(self, batch_id: str) -> bool:
        got = await self._renew(keys=[self.prefix + "lease:" + batch_id],
                                args=[self.owner, self.ttl_ms])
        return bool(int(got))

    async def release(self, batch_id: str) -> None:
        await self._release(keys=[self.prefix + "lease:" + batch_id], args=[self.owner])

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._r.aclose()
