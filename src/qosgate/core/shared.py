"""The shared-state sync protocol, sans I/O: what one gateway instance asks a shared store, and
how it applies the answers to its ``LeasedLedger`` and fair-share counters
(docs/guides/several-instances.md).

- requests/min and tokens/min: one token bucket per tenant and limit *in the store* (and per
  tenant, model and limit for a tenant's limit on one model; ``store_key``), refilled by
  the store's own clock; each instance leases stock from it (about twice its demand of the last
  interval, at most the limit / live instances) and gives back what it holds beyond that; a
  token estimate spent beyond what was leased is charged to the bucket unconditionally (the
  fleet's debt);
- concurrency caps: slots leased per instance until an expiry (``TTL``), renewed at every sync,
  so a crashed instance's slots are free again within the TTL;
- VTC fair-share counters: each instance pushes the growth of its counters per (queue node, key)
  and adds the growth the others pushed, so a tenant served elsewhere is behind here too;
- instances: a heartbeat with the same TTL; the live ones share the limits. It carries this
  instance's load (queued per class, completions per second; ``peers.py``), and its answer the
  others', which ``peers`` sums for admission to predict from the fleet's queue and rate.

The store unreachable for ``degrade_after`` seconds: *degraded* mode, once logged; fail open
(local buckets at each limit / live instances) or closed (limited tenants refused); when it
answers again, leases start afresh.

Why sans I/O: the asyncio gateway runs this against Redis (``runtime/shared_state.py``) and the
simulator runs it against ``MemoryStore`` in virtual time, each store call answered when its
driver says. A sync is a generator: it yields each store call (``Bucket``, ``Lease``,
``Heartbeat``, ``Counters``) and is sent the answer; the call's arguments are computed from the
ledger *when it is yielded*, as the old coroutine did between its awaits. A driver whose store
raised ``StoreDown`` abandons the generator and calls ``sync_failed(now, why)``: the clock is
handed in there, and read (a ``clock`` the driver gives) only to time the others' load heard.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Generator, Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from qosgate.config import TenantLimits
from qosgate.core.ledger import LeasedLedger, LeasedLimiter, fair_shares, merge_counter
from qosgate.core.peers import Load, PeerLoad, with_load


class StoreDown(Exception):
    """The store could not be reached (or answered with an error)."""


# ---------------------------------------------------------------- the store calls
@dataclass(frozen=True, slots=True)
class Bucket:
    """Charge ``force`` unconditionally, then take up to ``want`` (negative: give back).
    Answer: (granted, tokens left, seconds until one unit is there)."""

    key: str
    per_minute: float
    want: float
    force: float


@dataclass(frozen=True, slots=True)
class Lease:
    """Hold ``want`` slots of ``cap`` (fewer if others hold them) until now + ttl. Answer: the
    slots held."""

    key: str
    instance: str
    want: int
    cap: int
    ttl_s: float


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """This instance is alive until now + ttl. Answer: the live instances and their info."""

    instance: str
    ttl_s: float
    info: str


@dataclass(frozen=True, slots=True)
class Counters:
    """Add ``deltas`` to a hash of counters. Answer: the totals."""

    key: str
    deltas: dict[str, float]


StoreCall = Bucket | Lease | Heartbeat | Counters
# a sync (or a give-back): yields store calls, is sent each one's answer
Exchange = Generator[StoreCall, Any, None]


class Store(Protocol):
    """The store port as a synchronous driver uses it: each call answered at ``now`` (the
    store's clock), or ``StoreDown``. ``runtime.shared_state.RedisStore`` is the asynchronous
    one (every call one Lua script timed by Redis's own clock)."""

    def answer(self, call: StoreCall, now: float) -> object: ...


def run_to_end(exchange: Exchange, store: Store, now: float) -> None:
    """Drive ``exchange`` to its end against ``store``, every call answered at ``now``
    (``StoreDown`` propagates)."""
    try:
        call = next(exchange)
        while True:
            call = exchange.send(store.answer(call, now))
    except StopIteration:
        return


# ---------------------------------------------------------------- in memory
class MemoryStore:
    """The store's semantics in one process (tests, the simulator): several instances share
    one. ``down`` makes every call fail like an unreachable Redis. The arithmetic is the Lua
    scripts' (``runtime/shared_state.py``), step for step."""

    def __init__(self) -> None:
        self.down = False
        self._buckets: dict[str, tuple[float, float]] = {}
        self._leases: dict[str, dict[str, tuple[int, float]]] = {}
        self._instances: dict[str, tuple[float, str]] = {}
        self._counters: dict[str, dict[str, float]] = {}

    def answer(self, call: StoreCall, now: float) -> object:
        if self.down:
            raise StoreDown("store down")
        if type(call) is Bucket:
            return self.bucket(now, call.key, call.per_minute, call.want, call.force)
        if type(call) is Lease:
            return self.lease(now, call.key, call.instance, call.want, call.cap, call.ttl_s)
        if type(call) is Heartbeat:
            return self.heartbeat(now, call.instance, call.ttl_s, call.info)
        assert type(call) is Counters
        return self.counters(call.key, call.deltas)

    def bucket(self, now: float, key: str, per_minute: float, want: float, force: float
               ) -> tuple[float, float, float]:
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

    def lease(self, now: float, key: str, instance: str, want: int, cap: int,
              ttl_s: float) -> int:
        leases = self._leases.setdefault(key, {})  # instance -> (slots, expiry)
        for i in [i for i, (_, exp) in leases.items() if exp <= now or i == instance]:
            del leases[i]
        n = max(0, min(want, cap - sum(n for n, _ in leases.values())))
        if n > 0:
            leases[instance] = (n, now + ttl_s)
        return n

    def heartbeat(self, now: float, instance: str, ttl_s: float, info: str) -> dict[str, str]:
        self._instances[instance] = (now + ttl_s, info)
        for i in [i for i, (exp, _) in self._instances.items() if exp <= now]:
            del self._instances[i]
        return {i: inf for i, (_, inf) in self._instances.items()}

    def counters(self, key: str, deltas: dict[str, float]) -> dict[str, float]:
        h = self._counters.setdefault(key, {})
        for k, v in deltas.items():
            h[k] = h.get(k, 0.0) + v
        return dict(h)


# ---------------------------------------------------------------- the protocol
def _bucket(key: str, per_minute: float, want: float, force: float
            ) -> Generator[StoreCall, Any, tuple[float, float, float]]:
    return cast(tuple[float, float, float], (yield Bucket(key, per_minute, want, force)))


def _lease(key: str, instance: str, want: int, cap: int, ttl_s: float
           ) -> Generator[StoreCall, Any, int]:
    return cast(int, (yield Lease(key, instance, want, cap, ttl_s)))


class SyncProtocol:
    """One instance's side of the shared state: its ``LeasedLedger`` (and fair-share counters
    under ``policy_root``) kept in sync with a store, one ``sync()`` exchange at a time."""

    def __init__(
        self,
        ledger: LeasedLedger,
        instance: str,
        policy_root: object | None = None,
        interval: float = 0.05,
        lease_ttl: float = 2.0,
        fail_open: bool = True,
        degrade_after: float = 1.0,
        info: Callable[[], str] | None = None,
        load: Callable[[], Load] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.ledger = ledger
        self.instance = instance
        self.root = policy_root
        self.interval = interval
        self.lease_ttl = lease_ttl
        self.fail_open = fail_open
        # a store that does not answer for this long is down (before: no new leases, the
        # budgets held are spent, nothing more; one slow answer under load is not an outage)
        self.degrade_after = degrade_after
        self._failing_since: float | None = None
        self.info = info or (lambda: "{}")
        # this instance's load, published in every heartbeat (none: the info alone), and the
        # others' as the last heartbeat answered, timed by ``clock`` (none: at 0)
        self.load = load
        self.clock = clock or (lambda: 0.0)
        self.peers = PeerLoad(lease_ttl)
        self.degraded = False
        self.live = 1
        self.fleet: dict[str, str] = {}
        self.syncs = 0
        self.errors = 0
        self.degraded_events = 0
        self.recoveries = 0  # the driver tells of each change (the core does no I/O)
        # fair-share counters: (path, key) -> local counter after the last sync, store total seen
        # each counter and its lifts at the last sync: what changed since, less the lifts, is
        # the service this instance gave (a lift is local: VTC's floor among *its* backlog)
        self._seen_local: dict[tuple[str, str], tuple[float, float]] = {}
        self._seen_total: dict[tuple[str, str], float] = {}
        self._baseline = True

    # ------------------------------------------------------------ one sync
    def sync(self) -> Exchange:
        """One sync: heartbeat, every leased limiter, the fair-share counters."""
        info = self.info() if self.load is None else with_load(self.info(), self.load())
        fleet = cast(dict[str, str], (yield Heartbeat(self.instance, self.lease_ttl, info)))
        if self.degraded:
            self._recover()
        self.fleet = fleet
        self.peers.hear(fleet, self.instance, self.clock())
        self.live = max(1, len(fleet))
        self.ledger.set_live(self.live)
        for lim in self.ledger.every():
            if lim.limited and lim.mode == "leased":
                yield from self._sync_limiter(lim)
        if self.root is not None:
            yield from self._sync_counters()
        self.syncs += 1
        self._failing_since = None

    def sync_failed(self, now: float, why: str) -> None:
        """The store raised ``StoreDown`` during a sync (abandoned): down for ``degrade_after``
        seconds, the instance degrades."""
        self.errors += 1
        self.peers.expire(now)
        if self._failing_since is None:
            self._failing_since = now
        if not self.degraded and now - self._failing_since >= self.degrade_after:
            self._degrade(why)

    def give_back(self) -> Exchange:
        """Give the fleet back what this instance holds (at shutdown)."""
        for lim in self.ledger.every():
            limits = lim.limits
            if limits.requests_per_minute and lim.req_stock > 0:
                give, lim.req_stock = lim.req_stock, 0.0
                yield Bucket(store_key("rpm", lim), limits.requests_per_minute, -give, 0.0)
            if limits.tokens_per_minute and lim.tok_stock > 0:
                give, lim.tok_stock = lim.tok_stock, 0.0
                yield Bucket(store_key("tpm", lim), limits.tokens_per_minute, -give, 0.0)
            if limits.max_concurrent:
                yield Lease(store_key("conc", lim), self.instance, 0, limits.max_concurrent,
                            self.lease_ttl)
                lim.slots = 0

    def _degrade(self, why: str) -> None:
        self.degraded = True
        self.degraded_events += 1
        self.ledger.degrade(self.live, self.fail_open)

    def _recover(self) -> None:
        self.degraded = False
        self.ledger.recover()
        self._baseline = True  # the store may have restarted empty: counters start over
        self.recoveries += 1

    def _sync_limiter(self, lim: LeasedLimiter) -> Generator[StoreCall, Any, None]:
        limits = lim.limits
        live = self.live
        if limits.requests_per_minute:
            cap = limits.requests_per_minute
            demand = lim.admitted + lim.refused_req
            # twice the last interval's demand, at least a second of the limit's refill split
            # over the instances, at most the limit split over them
            target = max(1.0, min(math.ceil(cap / live), max(2.0 * demand, cap / 60 / live)))
            want = target - lim.req_stock
            if want < 0:  # off the local stock first: what is given back cannot be spent here
                lim.req_stock += want
                yield from _bucket(store_key("rpm", lim), cap, want, 0.0)
            elif want >= 1:
                granted, _left, wait = yield from _bucket(store_key("rpm", lim), cap,
                                                          math.floor(want), 0.0)
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
                yield from _bucket(store_key("tpm", lim), cap, want, force)
            elif force or want >= 1:
                granted, _left, wait = yield from _bucket(store_key("tpm", lim), cap, want,
                                                          force)
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
            lim.slots = yield from _lease(store_key("conc", lim), self.instance, want_c, cap_c,
                                          self.lease_ttl)
        lim.admitted = lim.used_tok = lim.refused_req = lim.refused_tok = lim.refused_conc = 0
        lim.peak = lim.concurrent

    def _sync_counters(self) -> Generator[StoreCall, Any, None]:
        baseline = self._baseline
        for path, share in list(fair_shares(self.root)):
            keys: dict[str, Hashable] = {str(k): k for k in share.counter}
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
            totals = cast(dict[str, float], (yield Counters(path, deltas)))
            for sk, k in keys.items():
                total = totals.get(sk, 0.0)
                before = self._seen_total.get((path, sk))
                if before is not None and not baseline:
                    others = total - before - deltas.get(sk, 0.0)
                    merge_counter(share, k, others)
                self._seen_total[(path, sk)] = total
                self._seen_local[(path, sk)] = (share.counter[k], lifted.get(k, 0.0))
        self._baseline = False


def store_key(kind: str, lim: LeasedLimiter) -> str:
    """The store's key of one limit (``kind``: rpm, tpm or conc) of ``lim``: ``rpm:<tenant>`` for
    a tenant's limit over all models, ``rpm/model:["<tenant>", "<model>"]`` for its limit on one
    model. (JSON, since a name may hold any character; and a tenant's key has ':' right after
    the kind, so no tenant's name makes one of the other scheme.)"""
    if not lim.model:
        return f"{kind}:{lim.tenant}"
    return f"{kind}/model:{json.dumps([lim.tenant, lim.model])}"


def prime(ledger: LeasedLedger, tenants: Iterable[tuple[str, TenantLimits]], now: float
          ) -> None:
    """Limiters for the configured tenants (and their limits on one model) before the first
    sync, so that their first requests find a lease waiting."""
    for name, limits in tenants:
        ledger.limiter(name, limits, now)
        for model, on_model in limits.models.items():
            ledger.limiter(name, on_model, now, model)
