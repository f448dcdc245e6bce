"""Leases with fencing in a real Redis: one owner at a time, fences that only grow, and a stale
owner that cannot renew or free a lease that passed to another."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosgate.runtime.batches.lease import LocalLease, RedisLease
from tests.gateway.redis_server import RedisServer


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    r = RedisServer(tmp_path_factory.mktemp("lease"))
    yield r
    r.stop()


def test_local_lease_takes_a_fence_above_the_stored_one() -> None:
    async def run() -> None:
        lease = LocalLease()
        assert await lease.acquire("batch_1", 6) == 7
        assert await lease.renew("batch_1")

    asyncio.run(run())


def test_one_owner_at_a_time_and_the_fence_grows_past_the_stored_one(redis: RedisServer) -> None:
    async def run() -> None:
        a = RedisLease(redis.url, "a", ttl_s=30, prefix="t1:")
        b = RedisLease(redis.url, "b", ttl_s=30, prefix="t1:")
        try:
            fa = await a.acquire("batch_1", 41)
            assert fa == 42
            assert await b.acquire("batch_1", 41) is None
            assert not await b.renew("batch_1")
            await b.release("batch_1")  # not b's: it stays a's
            assert await a.renew("batch_1")
            await a.release("batch_1")
            fb = await b.acquire("batch_1", 42)
            assert fb is not None and fb > fa
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())


def test_an_expired_owner_loses_the_lease_and_cannot_take_it_back(redis: RedisServer) -> None:
    async def run() -> None:
        a = RedisLease(redis.url, "a", ttl_s=0.05, prefix="t2:")
        b = RedisLease(redis.url, "b", ttl_s=30, prefix="t2:")
        try:
            fa = await a.acquire("batch_1", 0)
            assert fa is not None
            fb = None
            while fb is None:  # a does not renew: its lease runs out
                fb = await b.acquire("batch_1", fa)
                await asyncio.sleep(0.01)
            assert fb > fa
            assert not await a.renew("batch_1")
            await a.release("batch_1")
            assert await b.renew("batch_1")
        finally:
            await a.close()
            await b.close()

    asyncio.run(run())


def test_a_fresh_redis_still_gives_fences_above_the_stored_ones(tmp_path: Path) -> None:
    r = RedisServer(tmp_path)

    async def run() -> None:
        lease = RedisLease(r.url, "a", ttl_s=30)
        try:
            assert await lease.acquire("batch_9", 1000) == 1001
        finally:
            await lease.close()

    try:
        asyncio.run(run())
    finally:
        r.stop()
