"""Carries out the per-replica batchers' decisions (``core.batching``) in real time.

The core dispatches embeddings requests one by one, as it does every request; the driver hands
each one here instead of starting an engine call. The replica's ``Batcher`` says when a batch is
due (size, token budget, a realtime request, no room left, or its window); a batch is one engine
call (``Engine.run_batch``) serving every request in it. One timer (a loop ``call_later``) wakes
this at the earliest window end of all replicas; nothing sleeps in a loop.

A request pulled back or ended while it waits here is simply removed; one that ends while its
batch runs is skipped by the engine (its sink raises ``Withdrawn``). When a batch's call ends,
any request of it the engine did not report on fails (``engine_error``), and the batch's latency
(from its oldest request's arrival here) feeds the replica's window controller.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from qosgate.core import State
from qosgate.core.batching import Batch, Batcher, WindowDecision

if TYPE_CHECKING:
    from qosgate.runtime.driver import Driver, Ticket

log = logging.getLogger("qosgate.runtime.batches")

_SLACK_S = 0.0005
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class BatchEngine(Protocol):
    async def run_batch(self, calls: list[Any]) -> None: ...


@dataclass(slots=True)
class BatchStats:
    """Counters for the metrics: batches by release reason, sizes, controller decisions."""

    released: dict[tuple[str, str], int] = field(default_factory=dict)  # (replica, why)
    # replica -> batches per size bucket (SIZE_BUCKETS, the last +Inf), and the sizes' sum
    sizes: dict[str, list[int]] = field(default_factory=dict)
    size_sum: dict[str, int] = field(default_factory=dict)
    decisions: dict[tuple[str, str], int] = field(default_factory=dict)
    last: dict[str, WindowDecision] = field(default_factory=dict)


class BatchRunner:
    def __init__(
        self,
        driver: Driver,
        batchers: dict[str, Batcher],
        urgent_levels: int = 1,
        on_decision: Callable[[str, WindowDecision], None] | None = None,
    ) -> None:
        self.driver = driver
        self.batchers = batchers
        self.urgent_levels = urgent_levels  # class levels below this skip the window
        self.on_decision = on_decision
        self.where: dict[str, str] = {}  # rid -> replica, while it waits here
        self.tasks: set[asyncio.Task[None]] = set()
        self.running: dict[str, int] = {}  # rid -> the batch it runs in
        self._ids = 0
        self.stats = BatchStats()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = float("inf")

    def handles(self, replica: str) -> bool:
        return replica in self.batchers

    # ---------------------------------------------------------------- facts
    def add(self, replica: str, t: Ticket) -> None:
        now = self.driver.clock()
        b = self.batchers[replica]
        b.add(t.req.id, t.job.prompt_tokens, now, urgent=t.req.level < self.urgent_levels)
        self.where[t.req.id] = replica
        self._release(replica, now)
        self._arm()

    def remove(self, rid: str) -> None:
        replica = self.where.pop(rid, None)
        if replica is not None:
            self.batchers[replica].remove(rid)

    # ---------------------------------------------------------------- release
    def _room(self, replica: str) -> bool:
        rep = self.driver.scheduler.replicas.get(replica)
        return rep is not None and rep.free > 0

    def _release(self, replica: str, now: float) -> None:
        b = self.batchers[replica]
        for batch in b.release(now, self._room(replica)):
            self._run(replica, batch)

    def _run(self, replica: str, batch: Batch) -> None:
        st = self.stats
        key = (replica, batch.why)
        st.released[key] = st.released.get(key, 0) + 1
        n = len(batch.rids)
        counts = st.sizes.setdefault(replica, [0] * (len(SIZE_BUCKETS) + 1))
        counts[bisect_left(SIZE_BUCKETS, n)] += 1
        st.size_sum[replica] = st.size_sum.get(replica, 0) + n
        tickets = self.driver.tickets
        calls = []
        self._ids += 1
        bid = self._ids
        for rid in batch.rids:
            self.where.pop(rid, None)
            t = tickets.get(rid)
            if t is not None:
                calls.append(t)
                self.running[rid] = bid
        eng: BatchEngine = self.driver.engines[replica]  # type: ignore[assignment]
        task = self.driver.loop().create_task(eng.run_batch(calls))
        self.tasks.add(task)
        task.add_done_callback(lambda tk: self._ended(replica, batch, bid, calls, tk))

    def _ended(self, replica: str, batch: Batch, bid: int, calls: list[Ticket],
               task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        d = self.driver
        now = d.clock()
        if not task.cancelled():
            exc = task.exception()
            if exc is not None:
                log.error("embeddings batch on %s failed", replica, exc_info=exc)
        for t in calls:  # what the engine did not report on (and is not elsewhere since)
            rid = t.req.id
            if self.running.get(rid) != bid:
                continue
            del self.running[rid]
            if t.req.state in (State.DISPATCHED, State.RUNNING) and d.tickets.get(rid) is t:
                d.apply(d.scheduler.fail(rid, now, "engine_error"))
        dec = self.batchers[replica].finished(now, batch)
        if dec is not None:
            k = (replica, dec.decision)
            self.stats.decisions[k] = self.stats.decisions.get(k, 0) + 1
            self.stats.last[replica] = dec
            log.debug("batch window of %s: %s to %.1f ms (latency %.1f ms, mean batch %.1f)",
                      replica, dec.decision, dec.window_s * 1e3, dec.latency_s * 1e3,
                      dec.mean_batch)
            if self.on_decision is not None:
                self.on_decision(replica, dec)
        # a slot freed: a batch waiting for room may be due
        for name in self.batchers:
            self._release(name, now)
        self._arm()

    # ---------------------------------------------------------------- timer
    def poke(self) -> None:
        """Room at a replica may have changed (a request ended): release what is due."""
        if not self.where:
            return
        now = self.driver.clock()
        for name in self.batchers:
            self._release(name, now)
        self._arm()

    def _arm(self) -> None:
        deadlines = [d for b in self.batchers.values() if (d := b.deadline()) is not None]
        if not deadlines:
            return
        at = min(deadlines)
        if self._timer is not None:
            if at >= self._timer_at:
                return
            self._timer.cancel()
        self._timer_at = at
        delay = max(0.0, at - self.driver.clock()) + _SLACK_S
        self._timer = self.driver.loop().call_later(delay, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._timer_at = float("inf")
        now = self.driver.clock()
        for name in self.batchers:
            self._release(name, now)
        self._arm()

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
