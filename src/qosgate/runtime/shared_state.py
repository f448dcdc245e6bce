"""Tenant state shared by several gateway instances through Redis: the asyncio side of the
sync protocol (``core/shared.py``, sans I/O), its Redis store, and its metrics.

``SharedState`` runs ``SyncProtocol``'s exchanges every ``interval`` seconds, awaiting each store
call; ``RedisStore`` answers them with one atomic Lua script each, timed by Redis's own clock
(``TIME``). ``MemoryStore`` is the in-memory store (``core.shared.MemoryStore``) behind the same
asyncio interface, for tests: ``delay`` seconds before each call answers. The simulator runs the
same protocol against ``core.shared.MemoryStore`` in virtual time, without any of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

from prometheus_client.core import Metric

from qosgate import metric_names as mn
from qosgate.core import shared
from qosgate.core.ledger import LeasedLedger
from qosgate.core.peers import Load
from qosgate.core.shared import (
    Bucket,
    Counters,
    Exchange,
    Heartbeat,
    Lease,
    StoreCall,
    StoreDown,
    SyncProtocol,
)

__all__ = ["InstanceInfo", "MemoryStore", "RedisStore", "SharedState", "Store", "StoreDown",
           "new_instance_id", "status_of"]

log = logging.getLogger("qosgate.shared_state")


def new_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Store(Protocol):
    """The store port as the asyncio driver awaits it (see ``core.shared``'s calls)."""

    async def bucket(self, key: str, per_minute: float, want: float, force: float
                     ) -> tuple[float, float, float]: ...

    async def lease(self, key: str, instance: str, want: int, cap: int, ttl_s: float) -> int: ...

    async def heartbeat(self, instance: str, ttl_s: float, info: str) -> dict[str, str]: ...

    async def counters(self, key: str, deltas: dict[str, float]) -> dict[str, float]: ...

    async def close(self) -> None: ...


async def ask(store: Store, call: StoreCall) -> object:
    """One protocol call, awaited on ``store``."""
    if type(call) is Bucket:
        return await store.bucket(call.key, call.per_minute, call.want, call.force)
    if type(call) is Lease:
        return await store.lease(call.key, call.instance, call.want, call.cap, call.ttl_s)
    if type(call) is Heartbeat:
        return await store.heartbeat(call.instance, call.ttl_s, call.info)
    assert type(call) is Counters
    return await store.counters(call.key, call.deltas)


async def exchange(store: Store, steps: Exchange) -> None:
    """Drive one exchange of the protocol to its end (``StoreDown`` propagates; the generator is
    then closed)."""
    try:
        call = next(steps)
        while True:
            call = steps.send(await ask(store, call))
    except StopIteration:
        return
    finally:
        steps.close()


# ---------------------------------------------------------------- Redis
_BUCKET = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local cap = tonumber(ARGV[1]); local want = tonumber(ARGV[2]); local force = tonumber(ARGV[3])
local rate = cap / 60.0
local v = redis.call('HMGET', KEYS[1], 'tokens', 'ts')
local tokens = tonumber(v[1]); local ts = tonumber(v[2])
if tokens == nil then tokens = cap; ts = now end
if now > ts then tokens = math.min(cap, tokens + (now - ts) * rate) end
tokens = tokens - force
local granted
if want >= 0 then
  granted = math.max(0, math.min(want, tokens))
  tokens = tokens - granted
else
  granted = want
  tokens = math.min(cap, tokens - want)
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], 120000)
local wait = 0
if tokens < 1 then wait = (1 - tokens) / rate end
return {tostring(granted), tostring(tokens), tostring(wait)}
"""

_LEASE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local inst = ARGV[1]; local want = tonumber(ARGV[2]); local cap = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
local dead = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
for _, m in ipairs(dead) do redis.call('HDEL', KEYS[1], m) end
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
local others = 0
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  if all[i] ~= inst then others = others + tonumber(all[i + 1]) end
end
local n = math.max(0, math.min(want, cap - others))
if n > 0 then
  redis.call('HSET', KEYS[1], inst, n)
  redis.call('ZADD', KEYS[2], now + ttl, inst)
else
  redis.call('HDEL', KEYS[1], inst)
  redis.call('ZREM', KEYS[2], inst)
end
redis.call('PEXPIRE', KEYS[1], ttl * 2 + 1000)
redis.call('PEXPIRE', KEYS[2], ttl * 2 + 1000)
return n
"""

_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
local dead = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
for _, m in ipairs(dead) do redis.call('HDEL', KEYS[2], m) end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
return redis.call('HGETALL', KEYS[2])
"""

_COUNTERS = """
for i = 1, #ARGV, 2 do redis.call('HINCRBYFLOAT', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', KEYS[1], 3600000)
return redis.call('HGETALL', KEYS[1])
"""


class RedisStore:
    """The store in a real Redis (``redis`` package, asyncio client); every call is one atomic
    server-side script, timed by Redis's clock. ``timeout`` bounds each call."""

    def __init__(self, url: str, prefix: str = "qosgate:", timeout: float = 0.25) -> None:
        import redis.asyncio as aioredis

        self.url = url
        self.prefix = prefix
        self._r: Any = aioredis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, decode_responses=True,
            retry_on_timeout=False,
        )
        self._bucket = self._r.register_script(_BUCKET)
        self._lease = self._r.register_script(_LEASE)
        self._heartbeat = self._r.register_script(_HEARTBEAT)
        self._counters = self._r.register_script(_COUNTERS)

    async def _call(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        from redis.exceptions import RedisError

        try:
            return await script(keys=keys, args=args)
        except (TimeoutError, RedisError, OSError) as exc:
            raise StoreDown(str(exc) or type(exc).__name__) from exc

    async def bucket(self, key: str, per_minute: float, want: float, force: float
                     ) -> tuple[float, float, float]:
        g, left, wait = await self._call(self._bucket, [self.prefix + "b:" + key],
                                         [per_minute, want, force])
        return float(g), float(left), float(wait)

    async def lease(self, key: str, instance: str, want: int, cap: int, ttl_s: float) -> int:
        n = await self._call(self._lease, [self.prefix + "c:" + key, self.prefix + "ce:" + key],
                             [instance, want, cap, int(ttl_s * 1000)])
        return int(n)

    async def heartbeat(self, instance: str, ttl_s: float, info: str) -> dict[str, str]:
        flat = await self._call(self._heartbeat, [self.prefix + "instances",
                                                  self.prefix + "instance_info"],
                                [instance, int(ttl_s * 1000), info])
        return dict(zip(flat[::2], flat[1::2], strict=True))

    async def counters(self, key: str, deltas: dict[str, float]) -> dict[str, float]:
        args: list[Any] = []
        for k, v in deltas.items():
            args += [k, repr(float(v))]
        flat = await self._call(self._counters, [self.prefix + "v:" + key], args)
        return {k: float(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self._r.aclose()


# ---------------------------------------------------------------- in memory
class MemoryStore:
    """``core.shared.MemoryStore`` behind the asyncio interface (tests): several ledgers share
    it. ``delay`` seconds before each call answers (a store's round trip, ``sleep``); ``down``
    makes every call fail like an unreachable Redis; ``clock`` is the store's own clock."""

    def __init__(
        self,
        delay: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.delay = delay
        self.clock = clock
        self.sleep = sleep
        self.memory = shared.MemoryStore()

    @property
    def down(self) -> bool:
        return self.memory.down

    @down.setter
    def down(self, value: bool) -> None:
        self.memory.down = value

    async def _answer(self, call: StoreCall) -> Any:
        if self.delay > 0:
            await self.sleep(self.delay)
        return self.memory.answer(call, self.clock())

    async def bucket(self, key: str, per_minute: float, want: float, force: float
                     ) -> tuple[float, float, float]:
        return await self._answer(Bucket(key, per_minute, want, force))  # type: ignore[no-any-return]

    async def lease(self, key: str, instance: str, want: int, cap: int, ttl_s: float) -> int:
        return await self._answer(Lease(key, instance, want, cap, ttl_s))  # type: ignore[no-any-return]

    async def heartbeat(self, instance: str, ttl_s: float, info: str) -> dict[str, str]:
        return await self._answer(Heartbeat(instance, ttl_s, info))  # type: ignore[no-any-return]

    async def counters(self, key: str, deltas: dict[str, float]) -> dict[str, float]:
        return await self._answer(Counters(key, deltas))  # type: ignore[no-any-return]

    async def close(self) -> None:
        return None


# ---------------------------------------------------------------- the sync loop
class SharedState:
    """Keeps one instance's ``LeasedLedger`` (and fair-share counters) in sync with a store:
    ``SyncProtocol``'s exchanges on an asyncio loop, and their metrics."""

    def __init__(
        self,
        store: Store,
        ledger: LeasedLedger,
        clock: Callable[[], float],
        policy_root: object | None = None,
        instance: str | None = None,
        interval: float = 0.05,
        lease_ttl: float = 2.0,
        fail_open: bool = True,
        degrade_after: float = 1.0,
        info: Callable[[], str] | None = None,
        load: Callable[[], Load] | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.protocol = SyncProtocol(ledger, instance or new_instance_id(), policy_root,
                                     interval, lease_ttl, fail_open, degrade_after, info, load,
                                     clock)
        self._task: asyncio.Task[None] | None = None
        self._closing = False

    # what the gateway and the tests read (the rest: ``protocol``)
    @property
    def ledger(self) -> LeasedLedger:
        return self.protocol.ledger

    @property
    def degraded(self) -> bool:
        return self.protocol.degraded

    @property
    def live(self) -> int:
        return self.protocol.live

    # ------------------------------------------------------------ life
    async def start(self) -> None:
        """One sync before serving (degraded at once if the store does not answer), then the
        sync loop."""
        await self.sync()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if not self.degraded:  # give the fleet back what this instance holds
            with contextlib.suppress(StoreDown, Exception):
                await exchange(self.store, self.protocol.give_back())
        await self.store.close()

    async def _run(self) -> None:
        while not self._closing:
            interval = self.protocol.interval
            await asyncio.sleep(interval if not self.degraded else max(interval, 0.2))
            await self.sync()

    async def sync(self) -> None:
        p = self.protocol
        degrades, recoveries = p.degraded_events, p.recoveries
        why = ""
        try:
            await exchange(self.store, p.sync())
        except StoreDown as exc:
            why = str(exc)
            p.sync_failed(self.clock(), why)
        if p.recoveries > recoveries:
            log.warning("shared state reachable again: re-synced")
        if p.degraded_events > degrades:
            log.warning(
                "shared state unreachable (%s): degraded, %s at each limit / %d live instance(s)",
                why, "serving on local state" if p.fail_open else "refusing limited tenants",
                p.live,
            )

    # ------------------------------------------------------------ metrics
    def collect(self) -> Iterator[Metric]:
        p = self.protocol
        inst = p.instance
        g = mn.SHARED_DEGRADED.gauge()
        g.add_metric([inst], 1.0 if self.degraded else 0.0)
        yield g
        live = mn.SHARED_LIVE.gauge()
        live.add_metric([inst], float(self.live))
        yield live
        c = mn.SHARED_SYNCS.counter()
        c.add_metric([inst, "ok"], float(p.syncs))
        c.add_metric([inst, "error"], float(p.errors))
        yield c


class InstanceInfo:
    """``qosgate_instance_info{instance, shared_state}`` 1: which instance answered /metrics."""

    def __init__(self, instance: str, shared: str) -> None:
        self.instance = instance
        self.shared = shared

    def collect(self) -> Iterator[Metric]:
        g = mn.INSTANCE_INFO.gauge()
        g.add_metric([self.instance, self.shared], 1.0)
        yield g


def status_of(shared: SharedState | None, instance: str) -> dict[str, Any]:
    """The shared-state part of /v1/qos/status: who answered and the fleet as last synced."""
    if shared is None:
        return {"instance": instance, "shared_state": {"store": "none"}}
    fleet: dict[str, Any] = {}
    p = shared.protocol
    for inst, info in sorted(p.fleet.items()):
        try:
            fleet[inst] = json.loads(info)
        except ValueError:
            fleet[inst] = {}
    total_q = sum(int(v.get("queued_total", 0)) for v in fleet.values())
    total_i = sum(int(v.get("inflight", 0)) for v in fleet.values())
    return {
        "instance": instance,
        "shared_state": {
            "store": "redis",
            "degraded": p.degraded,
            "fail_open": p.fail_open,
            "live_instances": p.live,
            "fleet": fleet,
            "fleet_queued_total": total_q,
            "fleet_inflight": total_i,
        },
    }
