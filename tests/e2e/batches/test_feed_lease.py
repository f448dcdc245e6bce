"""Leases with fencing in a real Redis: one owner at a time, fences that only grow, a stale owner
that can neither renew nor free a lease that passed to another nor write to the job; and two
gateway processes sharing Redis and one batches directory running one job, every line once."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from qosgate.runtime.batches.lease import RedisLease
from qosgate.runtime.batches.records import Fenced, LineResult
from qosgate.runtime.batches.store import BatchStore
from tests.support.batches import (
    CHAT,
    answered_lines,
    bodies,
    client,
    completed_so_far,
    lines_of,
    submit,
    wait_status,
)
from tests.support.processes import start_gateway, start_standin
from tests.support.redis_server import RedisServer
from tests.support.waiting import wait_until


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    r = RedisServer(tmp_path_factory.mktemp("lease"))
    yield r
    r.stop()




@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_the_owner_that_lost_its_lease_cannot_write(redis: RedisServer, tmp_path: Path) -> None:
    async def run() -> None:
        store = BatchStore(tmp_path / "batches", time.time)
        await store.open()
        a = RedisLease(redis.url, "a", ttl_s=0.05, prefix="t3:")
        b = RedisLease(redis.url, "b", ttl_s=30, prefix="t3:")
        try:
            staged = store.staging_path()
            text = "".join(json.dumps({
                "custom_id": f"c{i}", "method": "POST", "url": CHAT,
                "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            }) + "\n" for i in range(3))
            staged.write_text(text)
            f = await store.add_file("t", "batch", "in.jsonl", staged, len(text), 3)
            job = await store.create_batch("t", f.id, CHAT, "24h", 86_400, "batch", None)
            fa = await a.acquire(job.id, job.fence)
            assert fa is not None and await store.claim(job.id, fa)
            await store.validate(job.id, lambda m: True, fa)
            assert await store.record(fa, [LineResult(job.id, 0, "r0", 200, b"{}")]) == 1
            fb = None
            while fb is None:  # a is paused past its lease
                fb = await b.acquire(job.id, fa)
                await asyncio.sleep(0.01)
            assert await store.claim(job.id, fb)
            with pytest.raises(Fenced):
                await store.record(fa, [LineResult(job.id, 1, "r1", 200, b"{}")])
            with pytest.raises(Fenced):
                await store.count_attempt(job.id, 2, fa)
            assert not await store.claim(job.id, fa)
            assert await store.record(fb, [LineResult(job.id, 1, "r1", 200, b"{}")]) == 1
        finally:
            await a.close()
            await b.close()
            await store.close()

    asyncio.run(run())


@pytest.mark.e2e
def test_two_gateways_sharing_redis_and_a_directory_answer_every_line_once(
        redis: RedisServer, tmp_path: Path) -> None:
    standin = start_standin(tmp_path, "--record", str(tmp_path / "bodies.jsonl"),
                            "--time-scale", "2")
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(f"""
tenants: [{{name: acme, api_keys: [sk-acme]}}]
upstreams: [{{url: {standin.url}, max_window: 4}}]
redis: {{url: "{redis.url}", prefix: "two:"}}
batches: {{dir: {tmp_path / "batches"}, lease_ttl_s: 1, live_span_s: 0.2}}
""")
    gws = [start_gateway(tmp_path, "--config", str(cfg))]
    try:
        c = client(gws[0])
        bid = submit(c, tmp_path, 200)
        # the first gateway owns the job (the only one up); once it has answered some lines a
        # second joins, and the first is killed (-9): the second takes the job over once the
        # first's lease has run out
        assert wait_until(lambda: completed_so_far(c, bid) >= 10, timeout=60, every=0.05)
        gws.append(start_gateway(tmp_path, "--config", str(cfg)))
        gws[0].proc.kill()
        gws[0].proc.wait()
        before = answered_lines(tmp_path / "batches")
        assert len(before) < 200
        c = client(gws[1])
        done = wait_status(c, bid, {"completed", "failed"})
        assert done.request_counts.model_dump() == {"total": 200, "completed": 200, "failed": 0}
        out = lines_of(c, done.output_file_id)
        assert Counter(x["custom_id"] for x in out) == Counter(f"req-{i}" for i in range(200))
        seen = bodies(tmp_path)
        assert set(seen) == set(range(200)) and max(seen.values()) <= 2
        assert not {line for line, n in seen.items() if n > 1} & before
    finally:
        for gw in gws:
            gw.stop()
        standin.stop()
