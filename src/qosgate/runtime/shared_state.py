"""Tenant state shared by several gateway instances through a store (Redis, or in memory).

The core admits against local leased budgets (``core.ledger.LeasedLedger``); this module keeps
them in sync with the store every ``interval`` seconds (docs/shared-state.md):

- requests/min and tokens/min: one token bucket per tenant and limit *in the store*, refilled by
  the store's own clock (Redis ``TIME`` inside a Lua script, atomic); each instance leases stock
  from it (about twice its demand of the last interval, at most the limit / live instances) and
  gives back what it holds beyond that; a token estimate spent beyond what was leased (a request
  that used more than estimated) is charged to the bucket unconditionally (the fleet's debt);
- concurrency caps: slots leased as members of a sorted set scored by their expiry (``TTL``);
  renewed at every sync, so a crashed instance's slots are free again within the TTL;
- VTC fair-share counters: each instance pushes the growth of its counters per (queue node, key)
  and adds the growth the others pushed (``HINCRBYFLOAT``), so a tenant served elsewhere is
  behind here too;
- instances: a sorted set of live instance ids (heartbeat with the same TTL).

The store unreachable: *degraded* mode, once logged; fail open (local buckets at each limit /
live instances) or closed (limited tenants refused); when it answers again, leases start afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import socket
import time
from collections.abc import Awaitable, Callable, Hashable, Iterator
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from qosgate.core.fairshare import FairShare
from qosgate.core.ledger import LeasedLedger, LeasedLimiter, fair_shares, merge_counter

log = logging.getLogger("qosgate.shared_state")


def new_instance_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class StoreDown(Exception):
    """The store could not be reached (or answered with an error)."""


class Store(Protocol):
    async def bucket(self, key: str, per_minute: float, want: float, force: float
                     ) -> tuple[float, float, float]:
        """Charge ``force`` unconditionally, then take up to ``want`` (negative: give back):
        (granted, tokens left, seconds until one unit is there)."""
        ...

    async def lease(self, key: str, instance: str, want: int, cap: int, ttl_s: float) -> int:
        """Hold ``want`` slots of ``cap`` (fewer if others hold them) until now + ttl."""
        ...

    async def heartbeat(self, instance: str, ttl_s: float, info: str) -> dict[str, str]:
        """This instance is alive until now + ttl; the live instances and their info."""
        ...

    async def counters(self, key: str, deltas: dict[str, float]) -> dict[str, float]:
        """Add ``deltas`` to a hash of counters; the totals."""
        ...

    async def close(self) -> None: ...


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
    """The same interface in one process (tests, the simulator): several ledgers share it.
    ``delay`` seconds before each call answers (a store's round trip); ``down`` makes every call
    fail like an unreachable Redis. ``clock`` is the store's own clock; ``sleep`` waits out the
    delay (asyncio's; the simulator passes one that suspends the call in *virtual* time, so that
    ``SharedState`` runs there unchanged)."""

    def __init__(
        self,
        delay: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.delay = delay
        self.clock = clock
        self.sleep = sleep
        self.down = False
        self._buckets: dict[str, tuple[float, float]] = {}
        self._leases: dict[str, dict[str, tuple[int, float]]] = {}
        self._instances: dict[str, tuple[float, str]] = {}
        self._counters: dict[str, dict[str, float]] = {}

    async def _wait(self) -> float:
        if self.delay > 0:
            await self.sleep(self.delay)
        if self.down:
            raise StoreDown("store down")
        return self.clock()

    async def bucket(self, key: str, per_minute: float, want: float, force: float
                     ) -> tuple[float, float, float]:
        now = await self._wait()
        tokens, ts = self._buckets.get(key, (per_minute, now))
        rate = per_minute / 60.0
        if now > ts:
            tokens = min(per_minute, tokens + (now - ts) * rate)
        tokens -= force
        if want >= 0:
            granted = max(0.0, min(want, tokens))
            tokens -= granted
        else:
            granted = want
            tokens = min(per_minute, tokens - want)
        self._buckets[key] = (tokens, now)
        return granted, tokens, (1 - tokens) / rate if tokens < 1 else 0.0

    async def lease(self, key: str, instance: str, want: int, cap: int, ttl_s: float) -> int:
        now = await self._wait()
        leases = self._leases.setdefault(key, {})  # instance -> (slots, expiry)
        for i in [i for i, (_, exp) in leases.items() if exp <= now or i == instance]:
            del leases[i]
        n = max(0, min(want, cap - sum(n for n, _ in leases.values())))
        if n > 0:
            leases[instance] = (n, now + ttl_s)
        return n

    async def heartbeat(self, instance: str, ttl_s: float, info: str) -> dict[str, str]:
        now = await self._wait()
        self._instances[instance] = (now + ttl_s, info)
        for i in [i for i, (exp, _) in self._instances.items() if exp <= now]:
            del self._instances[i]
        return {i: inf for i, (_, inf) in self._instances.items()}

    async def counters(self, key: str, deltas: dict[str, float]) -> dict[str, float]:
        await self._wait()
        h = self._counters.setdefault(key, {})
        for k, v in deltas.items():
            h[k] = h.get(k, 0.0) + v
        return dict(h)

    async def close(self) -> None:
        return None


# ---------------------------------------------------------------- the sync
class SharedState:
    """Keeps one instance's ``LeasedLedger`` (and fair-share counters) in sync with a store."""

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
    ) -> None:
        self.store = store
        self.ledger = ledger
        self.clock = clock
        self.root = policy_root
        self.instance = instance or new_instance_id()
        self.interval = interval
        self.lease_ttl = lease_ttl
        self.fail_open = fail_open
        # a store that does not answer for this long is down (before: no new leases, the
        # budgets held are spent, nothing more; one slow answer under load is not an outage)
        self.degrade_after = degrade_after
        self._failing_since: float | None = None
        self.info = info or (lambda: "{}")
        self.degraded = False
        self.live = 1
        self.fleet: dict[str, str] = {}
        self.syncs = 0
        self.errors = 0
        self.degraded_events = 0
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        # fair-share counters: (path, key) -> local counter after the last sync, store total seen
        # each counter and its lifts at the last sync: what changed since, less the lifts, is
        # the service this instance gave (a lift is local: VTC's floor among *its* backlog)
        self._seen_local: dict[tuple[str, str], tuple[float, float]] = {}
        self._seen_total: dict[tuple[str, str], float] = {}
        self._baseline = True

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
                for lim in self.ledger.limiters.values():
                    await self._give_back(lim)
        await self.store.close()

    async def _run(self) -> None:
        while not self._closing:
            await asyncio.sleep(self.interval if not self.degraded else max(self.interval, 0.2))
            await self.sync()

    # ------------------------------------------------------------ one sync
    async def sync(self) -> None:
        try:
            fleet = await self.store.heartbeat(self.instance, self.lease_ttl, self.info())
            if self.degraded:
                self._recover()
            self.fleet = fleet
            self.live = max(1, len(fleet))
            self.ledger.set_live(self.live)
            for lim in list(self.ledger.limiters.values()):
                if lim.limited and lim.mode == "leased":
                    await self._sync_limiter(lim)
            if self.root is not None:
                await self._sync_counters()
            self.syncs += 1
            self._failing_since = None
        except StoreDown as exc:
            self.errors += 1
            now = self.clock()
            if self._failing_since is None:
                self._failing_since = now
            if not self.degraded and now - self._failing_since >= self.degrade_after:
                self._degrade(str(exc))

    def _degrade(self, why: str) -> None:
        self.degraded = True
        self.degraded_events += 1
        self.ledger.degrade(self.live, self.fail_open)
        log.warning(
            "shared state unreachable (%s): degraded, %s at each limit / %d live instance(s)",
            why, "serving on local state" if self.fail_open else "refusing limited tenants",
            self.live,
        )

    def _recover(self) -> None:
        self.degraded = False
        self.ledger.recover()
        self._baseline = True  # the store may have restarted empty: counters start over
        log.warning("shared state reachable again: re-synced")

    async def _sync_limiter(self, lim: LeasedLimiter) -> None:
        limits = lim.limits
        live = self.live
        key = lim.tenant
        if limits.requests_per_minute:
            cap = limits.requests_per_minute
            demand = lim.admitted + lim.refused_req
            # twice the last interval's demand, at least a second of the limit's refill split
            # over the instances, at most the limit split over them
            target = max(1.0, min(math.ceil(cap / live), max(2.0 * demand, cap / 60 / live)))
            want = target - lim.req_stock
            if want < 0:  # off the local stock first: what is given back cannot be spent here
                lim.req_stock += want
                await self.store.bucket("rpm:" + key, cap, want, 0.0)
            elif want >= 1:
                granted, _left, wait = await self.store.bucket(
                    "rpm:" + key, cap, math.floor(want), 0.0)
                lim.req_stock += granted
                lim.retry_hint = max(self.interval, wait if lim.req_stock < 1 else 0.0)
        if limits.tokens_per_minute:
            cap = limits.tokens_per_minute
            force = max(0.0, -lim.tok_stock)  # spent beyond the lease: the fleet pays it now
            lim.tok_stock += force
            demand = lim.used_tok + lim.refused_tok
            target = max(min(cap / live, 1024.0), min(cap / live, 2.0 * demand))
            want = target - lim.tok_stock
            if want <= -1:
                lim.tok_stock += want
                await self.store.bucket("tpm:" + key, cap, want, force)
            elif force or want >= 1:
                granted, _left, wait = await self.store.bucket("tpm:" + key, cap, want, force)
                lim.tok_stock += granted
                if lim.tok_stock < 1:
                    lim.retry_hint = max(lim.retry_hint, wait)
        if limits.max_concurrent:
            cap_c = limits.max_concurrent
            # what it held at the peak of the last interval, a quarter more, plus what it
            # refused (one spare while it admits): a lease follows demand one sync late
            spare = lim.refused_conc or (1 if lim.admitted else 0)
            held = max(lim.concurrent, lim.peak)
            floor = cap_c // (4 * live)  # a large cap: lease ahead of demand
            want_c = min(cap_c, max(floor, held + max(spare, math.ceil(0.25 * held))))
            lim.slots = await self.store.lease(
                "conc:" + key, self.instance, want_c, cap_c, self.lease_ttl)
        lim.admitted = lim.used_tok = lim.refused_req = lim.refused_tok = lim.refused_conc = 0
        lim.peak = lim.concurrent

    async def _give_back(self, lim: LeasedLimiter) -> None:
        limits = lim.limits
        if limits.requests_per_minute and lim.req_stock > 0:
            give, lim.req_stock = lim.req_stock, 0.0
            await self.store.bucket("rpm:" + lim.tenant, limits.requests_per_minute, -give, 0.0)
        if limits.tokens_per_minute and lim.tok_stock > 0:
            give, lim.tok_stock = lim.tok_stock, 0.0
            await self.store.bucket("tpm:" + lim.tenant, limits.tokens_per_minute, -give, 0.0)
        if limits.max_concurrent:
            await self.store.lease("conc:" + lim.tenant, self.instance, 0,
                                   limits.max_concurrent, self.lease_ttl)
            lim.slots = 0

    def _shares(self) -> Iterator[tuple[str, FairShare[Hashable]]]:
        return fair_shares(self.root)

    async def _sync_counters(self) -> None:
        baseline = self._baseline
        for path, share in list(self._shares()):
            keys = {str(k): k for k in share.counter}
            lifted = share.lifted
            deltas: dict[str, float] = {}
            for sk, k in keys.items():
                seen = self._seen_local.get((path, sk))
                cur = share.counter[k]
                d = 0.0
                if seen is not None and not baseline:
                    d = (cur - seen[0]) - (lifted.get(k, 0.0) - seen[1])
                if d:
                    deltas[sk] = d
            totals = await self.store.counters(path, deltas)
            for sk, k in keys.items():
                total = totals.get(sk, 0.0)
                before = self._seen_total.get((path, sk))
                if before is not None and not baseline:
                    others = total - before - deltas.get(sk, 0.0)
                    merge_counter(share, k, others)
                self._seen_total[(path, sk)] = total
                self._seen_local[(path, sk)] = (share.counter[k], lifted.get(k, 0.0))
        self._baseline = False

    # ------------------------------------------------------------ metrics
    def collect(self) -> Iterator[Metric]:
        inst = self.instance
        g = GaugeMetricFamily("qosgate_shared_state_degraded",
                              "1 while the shared-state store is unreachable (local state at "
                              "each limit / live instances, or limited tenants refused).",
                              labels=["instance"])
        g.add_metric([inst], 1.0 if self.degraded else 0.0)
        yield g
        live = GaugeMetricFamily("qosgate_shared_state_live_instances",
                                 "Gateway instances alive in the shared state at the last sync.",
                                 labels=["instance"])
        live.add_metric([inst], float(self.live))
        yield live
        c = CounterMetricFamily("qosgate_shared_state_syncs", "Syncs with the shared state.",
                                labels=["instance", "outcome"])
        c.add_metric([inst, "ok"], float(self.syncs))
        c.add_metric([inst, "error"], float(self.errors))
        yield c


class InstanceInfo:
    """``qosgate_instance_info{instance, shared_state}`` 1: which instance answered /metrics."""

    def __init__(self, instance: str, shared: str) -> None:
        self.instance = instance
        self.shared = shared

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily("qosgate_instance_info",
                              "This gateway instance (1); shared_state: redis or none.",
                              labels=["instance", "shared_state"])
        g.add_metric([self.instance, self.shared], 1.0)
        yield g


def prime(ledger: LeasedLedger, tenants: Iterator[tuple[str, Any]] | list[tuple[str, Any]],
          now: float) -> None:
    """Limiters for the configured tenants before the first sync, so that their first requests
    find a lease waiting."""
    for name, limits in tenants:
        ledger.limiter(name, limits, now)


def status_of(shared: SharedState | None, instance: str) -> dict[str, Any]:
    """The shared-state part of /v1/qos/status: who answered and the fleet as last synced."""
    if shared is None:
        return {"instance": instance, "shared_state": {"store": "none"}}
    import json

    fleet: dict[str, Any] = {}
    for inst, info in sorted(shared.fleet.items()):
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
            "degraded": shared.degraded,
            "fail_open": shared.fail_open,
            "live_instances": shared.live,
            "fleet": fleet,
            "fleet_queued_total": total_q,
            "fleet_inflight": total_i,
        },
    }
