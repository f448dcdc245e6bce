"""Batching as a decorator over an engine: ``BatchingEngine`` is an ``Engine`` that collects the
embeddings calls it is given and runs them as batches on the engine it wraps (``run_batch``),
when its ``Batcher`` (``core.batching``, the policy) says a batch is due: size, token budget, a
realtime request, no room left at the replica, or its linger. Every other call goes straight
through. The driver knows nothing of batches: it starts a call, cancels it, and an embeddings
call simply takes longer to start.

A call waiting here is a task awaiting its batch's end. Pulled back or ended while it waits (the
driver cancels its task), it leaves the batcher; ended while its batch runs, it is skipped by the
engine (its sink raises ``Withdrawn``). When a batch's call ends, its calls' tasks end too: one
the engine did not report on is failed by the driver (``engine_error``), as any engine call that
ends without a word. The batch's latency (from its oldest request's arrival here) feeds the
linger controller. One ``DeadlineTimer`` wakes this at the batcher's linger end.

What the replica's room is (``room``) and when it may have changed (``room_changed``: a request
ended anywhere) are the wiring's (``server/compose.py``): the scheduler knows its replicas, this
does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from bisect import bisect_left
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from qosgate.core.batching import Batch, Batcher, LingerDecision
from qosgate.runtime.ports import Call, Engine, Health
from qosgate.runtime.timer import DeadlineTimer
from qosgate.wire.engine_request import Route, Unservable

log = logging.getLogger("qosgate.runtime.batches")

SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class BatchEngine(Engine, Protocol):
    """An engine that serves a batch of embeddings calls in one go."""

    async def run_batch(self, calls: list[Call]) -> None: ...


@dataclass(slots=True)
class BatchStats:
    """Counters for the metrics: batches by release reason, sizes, controller decisions."""

    released: dict[str, int] = field(default_factory=dict)  # why -> batches
    # batches per size bucket (SIZE_BUCKETS, the last +Inf), and the sizes' sum
    sizes: list[int] = field(default_factory=lambda: [0] * (len(SIZE_BUCKETS) + 1))
    size_sum: int = 0
    decisions: dict[str, int] = field(default_factory=dict)
    last: LingerDecision | None = None

    @property
    def batches(self) -> int:
        return sum(self.sizes)


@dataclass(slots=True, eq=False)
class _Waiting:
    """One embeddings call here: pending in the batcher until ``released``, then running."""

    call: Call
    done: asyncio.Future[None]  # resolved when its batch's engine call ended
    wait: Coroutine[Any, Any, None] | None = None  # the task's coroutine (``start_call``)
    released: bool = False

    def withdrawn(self) -> bool:
        """Its task was cancelled (awaiting ``done``), or it ended before it ever ran."""
        return self.done.cancelled() or (
            self.wait is not None
            and inspect.getcoroutinestate(self.wait) == inspect.CORO_CLOSED)


class BatchingEngine:
    """``inner`` with its embeddings calls batched by ``batcher``. ``room``: may the replica
    still take another dispatch; ``urgent_levels``: class levels below this skip the linger."""

    def __init__(
        self,
        inner: BatchEngine,
        batcher: Batcher,
        room: Callable[[], bool],
        clock: Callable[[], float],
        urgent_levels: int = 1,
    ) -> None:
        self.inner = inner
        self.batcher = batcher
        self.room = room
        self.clock = clock
        self.urgent_levels = urgent_levels
        self.name = inner.name
        self.max_window = inner.max_window
        self.pausable = inner.pausable
        self.resumes = inner.resumes
        self.ordered = inner.ordered
        self.remote = inner.remote
        # the inner engine's own ``start_call``, if it has one (the driver's convention)
        self._inner_start: Callable[[Call], Coroutine[Any, Any, None]] | None = getattr(
            inner, "start_call", None)
        self.stats = BatchStats()
        self._waiting: dict[str, _Waiting] = {}  # rid -> its call, while pending or running
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer = DeadlineTimer(clock, self._get_loop, self._release)

    def _get_loop(self) -> asyncio.AbstractEventLoop:
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    # ---------------------------------------------------------------- the engine, passed on
    @property
    def embeds(self) -> bool:
        return True

    @property
    def ready(self) -> bool:
        return self.inner.ready

    def models(self) -> list[str]:
        return self.inner.models()

    def model_cards(self) -> list[dict[str, Any]]:
        return self.inner.model_cards()

    def check_body(self, body: bytes, route: Route) -> Unservable | None:
        return self.inner.check_body(body, route)

    async def start(self) -> None:
        self._get_loop()
        await self.inner.start()

    async def probe(self) -> Health:
        return await self.inner.probe()

    def pause(self, rid: str) -> None:
        self.inner.pause(rid)

    def resume(self, rid: str) -> None:
        self.inner.resume(rid)

    async def close(self) -> None:
        self._timer.cancel()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.inner.close()

    # ---------------------------------------------------------------- calls
    async def run(self, call: Call) -> None:
        if call.engine_request.route != "embeddings":
            await self.inner.run(call)
            return
        await self._wait(self._collect(call))

    def start_call(self, call: Call) -> Coroutine[Any, Any, None]:
        """The call, for the driver to make a task of; an embeddings call is collected *now*
        (while the scheduler dispatches it: the room it sees is the scheduler's)."""
        if call.engine_request.route != "embeddings":
            start = self._inner_start
            return start(call) if start is not None else self.inner.run(call)
        w = self._collect(call)
        w.wait = self._wait(w)
        return w.wait

    def _collect(self, call: Call) -> _Waiting:
        rid = call.engine_request.rid
        old = self._waiting.pop(rid, None)
        if old is not None and not old.released:  # a pulled-back attempt not yet gone
            self.batcher.remove(rid)
        w = _Waiting(call, self._get_loop().create_future())
        self._waiting[rid] = w
        now = self.clock()
        self.batcher.add(rid, call.engine_request.prompt_tokens, now,
                         urgent=call.level() < self.urgent_levels)
        self._release_at(now)
        return w

    async def _wait(self, w: _Waiting) -> None:
        try:
            await w.done
        finally:
            self._forget(w)

    def _forget(self, w: _Waiting) -> None:
        rid = w.call.engine_request.rid
        if self._waiting.get(rid) is w:
            del self._waiting[rid]
            if not w.released:
                self.batcher.remove(rid)

    def room_changed(self) -> None:
        """Room at the replica may have changed (a request ended): release what is due."""
        if len(self.batcher):
            self._release()

    # ---------------------------------------------------------------- batches
    def _release(self) -> None:
        self._release_at(self.clock())

    def _release_at(self, now: float) -> None:
        for rid, w in list(self._waiting.items()):  # withdrawn since: not part of a batch
            if not w.released and w.withdrawn():
                del self._waiting[rid]
                self.batcher.remove(rid)
        for batch in self.batcher.release(now, self.room()):
            self._run(batch)
        deadline = self.batcher.deadline()
        if deadline is not None:
            self._timer.arm(deadline)

    def _run(self, batch: Batch) -> None:
        st = self.stats
        st.released[batch.why] = st.released.get(batch.why, 0) + 1
        n = len(batch.rids)
        st.sizes[bisect_left(SIZE_BUCKETS, n)] += 1
        st.size_sum += n
        members: list[_Waiting] = []
        for rid in batch.rids:
            w = self._waiting.get(rid)
            if w is not None:
                w.released = True
                members.append(w)
        task = self._get_loop().create_task(self.inner.run_batch([w.call for w in members]))
        self._tasks.add(task)
        task.add_done_callback(lambda tk: self._ended(batch, members, tk))

    def _ended(self, batch: Batch, members: list[_Waiting], task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        now = self.clock()
        if not task.cancelled():
            exc = task.exception()
            if exc is not None:
                log.error("embeddings batch on %s failed", self.name, exc_info=exc)
        for w in members:  # their tasks end (one not reported on is failed by the driver)
            if not w.done.done():
                w.done.set_result(None)
            if w.withdrawn():  # its task never ran: nothing else forgets it
                self._forget(w)
        dec = self.batcher.finished(now, batch)
        if dec is not None:
            st = self.stats
            st.decisions[dec.decision] = st.decisions.get(dec.decision, 0) + 1
            st.last = dec
            log.debug("linger of %s: %s to %.1f ms (latency %.1f ms, mean batch %.1f)",
                      self.name, dec.decision, dec.linger_s * 1e3, dec.latency_s * 1e3,
                      dec.mean_batch)
        self._release_at(now)  # a batch in flight fewer: one waiting for it may be due
