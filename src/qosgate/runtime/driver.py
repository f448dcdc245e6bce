"""The asyncio driver: the real-time clock and the I/O around the sans-I/O scheduler.

It owns the ``Scheduler`` and feeds it facts with ``time.monotonic()`` as the clock; a single
timer handle wakes it at ``scheduler.next_timer()`` (queue timeouts, aging, a replica's cooling or
ejection ending). It owns the health cadence too: every ``probe_interval_s`` it probes every
replica at once and hands the core what it found (``observe``). An engine sees the client through
the ticket's ``DeliverySink``, whose ``start`` is where the core learns of the first byte.
Every decision the core returns is carried out here:

- ``Dispatch``: start the engine call on that replica (a task), or resume a paused one;
- ``Preempt``: pause the sequence in an in-process engine, or cancel the engine call (which aborts
  it upstream) -- the client keeps waiting, its request re-queued; a stream evicted after its
  first byte keeps its transcript on the ticket, and its next call continues from there;
- ``Finished``: resolve the client's ticket; if an engine call is still going, it is cancelled.

Everything runs on the event loop thread, so the core needs no locks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

from qosgate.core import AttemptFailed, Dispatch, Finished, Preempt, Request, Scheduler, State
from qosgate.core.decisions import Decision
from qosgate.core.queueing.engine_order import order_value
from qosgate.core.reasons import upstream
from qosgate.runtime.ports import Engine, Health, SendFn, Sink, Withdrawn
from qosgate.runtime.replica_log import ReplicaLog
from qosgate.runtime.timer import DeadlineTimer
from qosgate.wire.engine_request import EngineRequest
from qosgate.wire.resume import transcript_for

log = logging.getLogger("qosgate.runtime")


class DeliverySink:
    """The client's sink as an engine sees it. Its ``start`` -- the first byte leaving for the
    client -- tells the core (``first_byte``), and raises ``Withdrawn`` instead if the request
    may no longer be delivered (pulled back or ended meanwhile). ``send`` is the client sink's
    own method: no extra frame per chunk."""

    __slots__ = ("_ticket", "client", "send")

    def __init__(self, ticket: Ticket, client: Sink) -> None:
        self._ticket = ticket
        self.client = client
        self.send: SendFn = client.send

    @property
    def started(self) -> bool:
        return self.client.started

    @property
    def complete(self) -> bool:
        return self.client.complete

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        t = self._ticket
        d = t._driver
        if not self.client.started:
            # a whole answer: its TTFT (and so TPOT) is the engine's first token, not the
            # delivery of the answer (the first byte the core is told of here)
            if not d.scheduler.first_byte(t.req.id, d.clock(), t.first_token_at):
                raise Withdrawn(t.req.id)
            d.rearm()  # a first byte may have made a timer due (a window that grew)
        await self.client.start(status, headers)


class Ticket:
    """One client request as the driver tracks it; it is also the engine's ``Call``."""

    __slots__ = (
        "_driver",
        "answer",
        "client",
        "engine_request",
        "finished",
        "first_token_at",
        "req",
        "sink",
        "task",
        "transcript",
    )

    def __init__(self, driver: Driver, req: Request, engine_request: EngineRequest,
                 sink: Sink) -> None:
        self._driver = driver
        self.req = req
        self.engine_request = engine_request
        self.client = sink
        self.sink = DeliverySink(self, sink)
        self.task: asyncio.Task[None] | None = None
        self.answer: tuple[int, bytes] | None = None  # an engine's refusal, for the client
        self.first_token_at: float | None = None  # the engine's, for a whole answer
        # a stream that can continue on another call (after an eviction or a failed replica)
        self.transcript = (transcript_for(engine_request.route, True, engine_request.body,
                                          engine_request.include_usage)
                           if engine_request.stream else None)
        req.resumable = self.transcript is not None
        # resolved once the request reached its terminal state (req.state / req.reason)
        self.finished: asyncio.Future[None] = driver.loop().create_future()

    # ---- engines.base.Call
    def order(self) -> int:
        req = self.req
        return req.order if req.order is not None else order_value(req.level, 0.0)

    def levels(self) -> int:
        return len(self._driver.scheduler.classes)

    def level(self) -> int:
        return self.req.level

    def progress(self, tokens: int) -> None:
        self._driver.scheduler.progress(self.req.id, tokens)

    def output_cap(self) -> int:
        return self.req.max_tokens

    def token_s(self) -> float | None:
        rep = self._driver.scheduler.replicas.get(self.req.replica or "")
        return None if rep is None else rep.itl_s

    def first_token(self) -> None:
        d = self._driver
        self.first_token_at = d.clock()

    def done(self, output_tokens: int, prompt_tokens: int | None = None,
             cached_tokens: int | None = None) -> None:
        d = self._driver
        self.task = None  # the call is ending by itself: not to be cancelled
        req = self.req
        if cached_tokens is not None and d.on_cached is not None and req.replica is not None:
            d.on_cached(req.replica, prompt_tokens or req.prompt_tokens, cached_tokens)
        d.apply(d.scheduler.complete(req.id, d.clock(), output_tokens, prompt_tokens,
                                     cached_tokens=cached_tokens))

    def failed(self, reason: str, output_tokens: int = 0) -> None:
        d = self._driver
        self.task = None
        d.apply(d.scheduler.fail(self.req.id, d.clock(), reason, output_tokens))

    def attempt_failed(self, fact: AttemptFailed) -> None:
        d = self._driver
        self.task = None  # a retry starts a call of its own
        d.apply(d.scheduler.attempt_failed(self.req.id, d.clock(), fact))

    def timed_out(self, reason: str) -> None:
        d = self._driver
        self.task = None
        d.apply(d.scheduler.timed_out(self.req.id, d.clock(), reason))

    def moved(self, fact: AttemptFailed) -> None:
        d = self._driver
        self.task = None  # a continuation starts a call of its own
        d.apply(d.scheduler.stream_broke(self.req.id, d.clock(), fact))

    def unresumable(self) -> None:
        self._driver.scheduler.unresumable(self.req.id)

    def continued(self, prompt_tokens: int, cached_tokens: int | None) -> None:
        self._driver.scheduler.continued(self.req.id, prompt_tokens, cached_tokens)

    def refused(self, status: int, body: bytes) -> None:
        d = self._driver
        self.task = None
        self.answer = (status, body)
        d.apply(d.scheduler.engine_refused(self.req.id, d.clock(), upstream(status)))


class Driver:
    def __init__(
        self,
        scheduler: Scheduler,
        engines: dict[str, Engine],
        *,
        clock: Callable[[], float] = time.monotonic,
        on_finished: Callable[[Request], None] | None = None,
        on_cached: Callable[[str, int, int], None] | None = None,
        probe_interval_s: float = 1.0,
    ) -> None:
        self.scheduler = scheduler
        self.engines = engines
        self.clock = clock
        self.on_finished = on_finished
        # an engine reported its prefix cache for a completed call: (replica, prompt tokens
        # offered, of those cached)
        self.on_cached = on_cached
        self.probe_interval_s = probe_interval_s
        self._probing: asyncio.Task[None] | None = None
        self._up: dict[str, bool] = {}
        self.replica_log = ReplicaLog(log)  # up/down lines, paced per replica
        self.tickets: dict[str, Ticket] = {}
        self.accepting = True
        self._settled: asyncio.Future[None] | None = None  # ``settled``'s, while it waits
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer = DeadlineTimer(lambda: self.clock(), self.loop, self._on_timer)

    def loop(self) -> asyncio.AbstractEventLoop:
        """The running loop, looked up once: on Python 3.11 every ``get_running_loop()`` costs a
        ``getpid()`` system call."""
        loop = self._loop
        if loop is None or loop.is_closed():
            loop = self._loop = asyncio.get_running_loop()
        return loop

    # ------------------------------------------------------------------ life
    async def start(self) -> None:
        """Start every engine, probe them all at once, then keep probing on the interval."""
        await asyncio.gather(*(eng.start() for eng in self.engines.values()))
        await self.probe_all()
        for name, up in self._up.items():
            if not up:
                log.warning("replica %s is not ready at start-up: its requests wait (or are "
                            "refused with 503 and Retry-After) until a probe finds it up", name)
        self._probing = self.loop().create_task(self._probe_loop())

    async def close(self) -> None:
        if self._probing is not None:
            self._probing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probing
        for t in list(self.tickets.values()):
            self.cancel(t, "server_shutdown")
        self._timer.cancel()
        for eng in self.engines.values():
            await eng.close()

    async def probe_all(self) -> None:
        """Probe every replica concurrently and hand the core what each probe found."""
        names = list(self.engines)
        found = await asyncio.gather(
            *(self.engines[n].probe() for n in names), return_exceptions=True
        )
        for name, h in zip(names, found, strict=True):
            if not isinstance(h, Health):
                if isinstance(h, BaseException) and not isinstance(h, Exception):
                    raise h
                log.error("probe of replica %s failed", name, exc_info=h)
                h = Health(up=False)
            self._up[name] = h.up
            now = self.clock()
            self.replica_log.probed(name, h.up, now)
            signals = None if h.signals is None else dataclasses.replace(h.signals, at=now)
            self.apply(
                self.scheduler.observe(name, now, up=h.up, models=h.models, signals=signals)
            )

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self.probe_all()
            except Exception:  # pragma: no cover - probing must never stop
                log.exception("probing replicas failed")

    def drain(self, reason: str = "shutting_down") -> tuple[int, int]:
        """Stop admitting; end every request whose answer has not begun -- queued, or sent to a
        remote engine that has sent nothing back yet (likely waiting in its queue; the call is
        cancelled, which aborts it there) -- so that its client can retry elsewhere now rather
        than wait out the drain. Requests whose answer has begun go on, and so do those sent to
        an engine in this process (sent there, a request is being computed). Returns how many
        were queued, and how many sent but not begun."""
        self.accepting = False
        queued = [t for t in self.tickets.values() if t.req.state is State.QUEUED]
        waiting = [t for t in self.tickets.values() if self._unbegun_at_remote(t)]
        for t in queued + waiting:
            self.cancel(t, reason)
        return len(queued), len(waiting)

    def _unbegun_at_remote(self, t: Ticket) -> bool:
        """Sent to a remote engine, which sent nothing back: no first byte to the client (a
        stream's first chunk), no whole answer yet. A whole answer sends nothing until it is
        done, so one waiting in the engine's queue cannot be told from one nearly done: both
        are taken as not begun (a drain refuses them at once, for their clients to retry on
        another gateway, rather than hold the drain to its timeout)."""
        replica = t.req.replica
        return (t.req.state is State.DISPATCHED and t.first_token_at is None
                and replica is not None and self.engines[replica].remote)

    async def settled(self) -> None:
        """Return once no request is live (after ``drain``: once the running ones ended)."""
        if not self.tickets:
            return
        if self._settled is None or self._settled.done():
            self._settled = self.loop().create_future()
        await asyncio.shield(self._settled)

    def _check_settled(self) -> None:
        settled = self._settled
        if settled is not None and not self.tickets and not settled.done():
            settled.set_result(None)

    # ------------------------------------------------------------------ events
    def ticket(self, req: Request, engine_request: EngineRequest, sink: Sink) -> Ticket:
        return Ticket(self, req, engine_request, sink)

    def submit(self, t: Ticket) -> None:
        """Hand a new request to the scheduler; ``t.finished`` resolves at its terminal state
        (at once if refused)."""
        self.tickets[t.req.id] = t
        self.apply(self.scheduler.submit(t.req, self.clock()))

    def cancel(self, t: Ticket, reason: str = "client_disconnected") -> None:
        if t.finished.done():
            return
        task, t.task = t.task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()  # aborts the engine call at once
        # the core charges what was streamed so far (``progress``)
        self.apply(self.scheduler.cancel(t.req.id, self.clock(), reason))
        if not t.finished.done():  # the core no longer knew it (cannot happen; be safe)
            self.tickets.pop(t.req.id, None)
            t.finished.set_result(None)
            self._check_settled()

    # ------------------------------------------------------------------ decisions
    def apply(self, decisions: list[Decision]) -> None:
        for d in decisions:
            if type(d) is Dispatch:
                self._dispatch(d)
            elif type(d) is Finished:
                self._finished(d.req)
            elif type(d) is Preempt:
                self._preempt(d)
        self._arm()

    def _dispatch(self, d: Dispatch) -> None:
        t = self.tickets.get(d.req.id)
        if t is None:  # pragma: no cover - every live request has a ticket
            log.error("dispatch of unknown request %s", d.req.id)
            return
        eng = self.engines[d.replica]
        if d.resume and t.task is not None and not t.task.done():
            eng.resume(d.req.id)
            return
        # an engine that can start a call at once (its request written during this dispatch,
        # not a loop turn later) says so with ``start_call``
        start = getattr(eng, "start_call", None)
        t.first_token_at = None  # a new attempt (a retry, or after a pull-back)
        task = self.loop().create_task(start(t) if start is not None else eng.run(t))
        t.task = task
        task.add_done_callback(functools.partial(self._call_ended, t))

    def _preempt(self, d: Preempt) -> None:
        t = self.tickets.get(d.req.id)
        if t is None:  # pragma: no cover
            return
        if d.pause:
            self.engines[d.replica].pause(d.req.id)
            return
        task, t.task = t.task, None
        if task is not None:
            task.cancel()

    def _finished(self, req: Request) -> None:
        t = self.tickets.pop(req.id, None)
        if t is None:
            return
        task, t.task = t.task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if self.on_finished is not None:
            try:
                self.on_finished(req)
            except Exception:  # pragma: no cover - metrics must never break serving
                log.exception("on_finished hook failed")
        if not t.finished.done():
            t.finished.set_result(None)
        if self._settled is not None:
            self._check_settled()

    def _call_ended(self, t: Ticket, task: asyncio.Task[None]) -> None:
        """An engine call ended without reporting (a bug or an unexpected error): fail it."""
        if task.cancelled() or t.task is not task:
            return
        exc = task.exception()
        if isinstance(exc, Withdrawn):
            return  # the request was pulled back meanwhile; the core has it
        if exc is not None:
            log.error("engine call for %s failed", t.req.id, exc_info=exc)
        t.task = None
        if t.req.state in (State.DISPATCHED, State.RUNNING):
            self.apply(self.scheduler.fail(t.req.id, self.clock(), "engine_error"))

    # ------------------------------------------------------------------ timers
    def rearm(self) -> None:
        """Make sure the timer fires by ``scheduler.next_timer()`` (after a fact that returns
        no decisions)."""
        self._arm()

    def _arm(self) -> None:
        nt = self.scheduler.next_timer()
        if nt is not None:
            self._timer.arm(nt)

    def _on_timer(self) -> None:
        self.apply(self.scheduler.tick(self.clock()))
