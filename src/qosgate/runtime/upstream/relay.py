"""A streamed engine response relayed to the client (``Relay``), or gathered whole for a client
that wants its answer in one piece (``Gather``), from the connection's own callbacks.

A chunk is written to the client in the callback that read it, not a loop turn later by the call's
task. The sink's calls are coroutines (ASGI's ``send`` is one) that nearly always complete
without waiting; ``SinkStep`` runs one by hand that far, and leaves the rest, if it must wait, to
the call's task.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Coroutine
from typing import Any

from qosgate.runtime.ports import Call
from qosgate.runtime.upstream.transport import Connection, UpstreamError
from qosgate.runtime.upstream.watchdog import Watchdog
from qosgate.wire.engine_request import Route
from qosgate.wire.resume import Transcript
from qosgate.wire.sse import DONE_LINE

# chat's and completions' usage, or the Responses API's (output_tokens, input_tokens)
_COMPLETION_TOKENS = re.compile(rb'"(?:completion|output)_tokens"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"(?:prompt|input)_tokens"\s*:\s*(\d+)')
_TEXT_DELTA = b'"type":"response.output_text.delta"'  # (vLLM writes no spaces)
_CACHED_TOKENS = re.compile(rb'"cached_tokens"\s*:\s*(\d+)')
# (completion, prompt, cached prompt) tokens of an answer's usage; None where it did not say
Usage = tuple[int, int | None, int | None]
_SSE_CACHE = (b"cache-control", b"no-cache")


class SinkStep:
    """A sink call (a coroutine) that had to wait, after ``SinkStep.run`` ran it by hand, through
    the coroutine protocol, as far as it went: in a task, every chunk would wait for the loop's
    next turn, when nearly every sink call completes without waiting at all.

    A call that must wait yields what it waits on: a future, or ``None`` for a bare yield (as
    ``asyncio.sleep(0)`` makes). ``finish``, awaited by the call's task, then does what a task
    does: waits for that, resumes the call, and so on until it returns; an exception or a
    cancellation of the task meanwhile is thrown into the call, and the future it waited on is
    cancelled.
    """

    __slots__ = ("coro", "waiting")

    def __init__(self, coro: Coroutine[Any, Any, None], waiting: object) -> None:
        self.coro = coro
        self.waiting = self._checked(waiting)

    @staticmethod
    def run(coro: Coroutine[Any, Any, None]) -> SinkStep | None:
        """Run a sink call as far as it goes now: None if it returned, else what is left."""
        try:
            waiting = coro.send(None)
        except StopIteration:
            return None
        return SinkStep(coro, waiting)

    async def finish(self) -> None:
        """Run the call to its end (in the call's task), from where it waits."""
        coro = self.coro
        while True:
            waiting = self.waiting
            thrown: BaseException | None = None
            try:
                if waiting is None:
                    await asyncio.sleep(0)
                else:
                    await asyncio.wait((waiting,))
            except BaseException as exc:
                if waiting is not None:
                    waiting.cancel()
                thrown = exc
            try:
                nxt = coro.send(None) if thrown is None else coro.throw(thrown)
            except StopIteration:
                return
            self.waiting = self._checked(nxt)

    def _checked(self, waiting: object) -> asyncio.Future[Any] | None:
        if waiting is None or asyncio.isfuture(waiting):
            return waiting
        self.coro.close()
        raise RuntimeError(f"a sink call waited on {waiting!r}, not on a future")

    def close(self) -> None:
        self.coro.close()


class Relay:
    """Relays a streamed response from the connection's own callbacks, as it arrives.

    Each socket read's body bytes are written to the client within that read's callback: no
    hand-over to the call's task, no wait for the loop's next turn. (With the hand-over, a burst
    of 64 streams' tokens from one engine step queued every chunk behind all the other reads:
    0.3 ms at the median and 1-2 ms at p90 between reading a chunk and writing it.) The call's
    task only waits for the end. A write that cannot complete at once (a slow client: the ASGI
    server's flow control) is handed to the task, which finishes it while the connection stops
    reading (backpressure on the engine), then relaying goes on. An error status is left to the
    task too (``outcome == "status"``).
    """

    def __init__(self, call: Call, dog: Watchdog, transcript: Transcript | None = None) -> None:
        self.call = call
        self.dog = dog
        # an answer that can continue on another call: its events go through its transcript
        # (token ids noted, and written as the client expects them), whole events at a time
        self.transcript = transcript
        # how its route's events carry tokens and usage: decided once, not per chunk
        route = call.engine_request.route
        self.tokens_in = response_deltas if route == "responses" else token_events
        self.usage_key = usage_key(route)
        self.sink = call.sink
        self.task: asyncio.Task[Any] | None = None
        self.conn: Connection | None = None

    def counts(self) -> Usage:
        tr = self.transcript
        if tr is not None and tr.segment:  # continued: the client's prompt, every token
            return len(tr.ids), len(tr.prompt_ids or ()), None
        if self.usage is not None:
            return self.usage
        return self.tokens, None, None

    async def run(self, conn: Connection) -> None:
        """Relay ``conn``'s response (its request just sent) until it ends; raises its error."""
        self.conn = conn
        self.task = asyncio.current_task(conn.loop)
        self.first = True
        # a continuation: its client has had the answer's head and first part already
        self.resumed = self.sink.started
        self.tokens = 0  # data events that carry a token (see _count)
        self.usage: Usage | None = None
        self.outcome: str | None = None  # "complete" | "status"
        self.exc: BaseException | None = None
        self.stalled: SinkStep | None = None  # a sink call that must wait: the task's to finish
        self.pending: tuple[bytes, bool] | None = None  # to send once a stalled start is done
        self.turn: asyncio.Future[None] = conn.loop.create_future()  # the task's turn
        conn.listener = self.push
        try:
            self.push()  # anything already there
            while True:
                await self.turn
                if self.exc is not None:
                    raise self.exc
                if self.stalled is not None:
                    await self.stalled.finish()
                    self.stalled = None
                    if self.pending is not None:
                        data, last = self.pending
                        self.pending = None
                        await self.sink.send(data, not last)
                if self.outcome is not None:
                    return
                if conn.error is not None:
                    raise conn.error
                self.turn = conn.loop.create_future()
                conn.resume()
                self.push()
        finally:
            if conn.listener == self.push:  # not if the pool gave it to another call since
                conn.listener = None
            if self.stalled is not None:
                self.stalled.close()

    def _yield_turn(self) -> None:
        if not self.turn.done():
            self.turn.set_result(None)

    def _drive(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Run a sink call as far as it goes now; True if it must wait (the task finishes it)."""
        step = SinkStep.run(coro)
        if step is None:
            return False
        self.stalled = step
        assert self.conn is not None
        self.conn.pause()
        self._yield_turn()
        return True

    def push(self) -> None:
        """The connection has news (headers, body bytes, the end, an error): forward what can
        be."""
        if self.turn.done():
            return  # the task has the turn
        task = self.task
        if task is not None and (task.cancelling() or task.done()):
            return  # pulled back: nothing more may reach the client
        conn = self.conn
        assert conn is not None
        try:
            if self.first:
                if not conn.headers_done:
                    if conn.error is not None:
                        self._yield_turn()
                    return
                if conn.status >= 400:
                    self.outcome = "status"
                    self._yield_turn()
                    return
            tr = self.transcript
            while True:
                data = conn.take()
                last = conn.complete and not conn.parts
                if not data and not last:
                    if conn.error is not None:
                        self._yield_turn()
                    return
                if tr is not None:
                    exact = tr.exact
                    data = tr.feed(data)
                    if exact and not tr.exact:
                        self.call.unresumable()
                    if not data and not last:
                        continue  # the rest of an event is still to come
                if self.first and self.resumed:
                    self.first = False
                    self.dog.delivered = True
                elif self.first:
                    self.first = False
                    headers = [(b"content-type", conn.content_type or b"application/json")]
                    if data:
                        headers.append(_SSE_CACHE)
                    # the sink raises Withdrawn here if the request was pulled back meanwhile
                    stalled = self._drive(self.sink.start(conn.status, headers))
                    self.dog.delivered = True
                    if stalled:
                        self.pending = (data, last)
                        self._count(data)
                        if last:
                            self._end()
                        return
                self._count(data)
                if last:
                    self._end()
                if self._drive(self.sink.send(data, not last)):
                    return
                if last:
                    self._yield_turn()
                    return
        except Exception as exc:  # handed to the task, which raises it
            self.exc = exc
            self._yield_turn()

    def _count(self, data: bytes) -> None:
        self.dog.last = self.dog.loop.time()
        tr = self.transcript
        if tr is not None and (tr.exact or tr.segment):  # (an engine that sent ids)
            if len(tr.ids) > self.tokens:
                self.tokens = len(tr.ids)
                self.call.progress(self.tokens)
            if not tr.segment and self.usage_key in data:
                self.usage = usage_counts(data) or self.usage
            return
        events = self.tokens_in(data)
        if events > 0:
            self.tokens += events
            self.call.progress(self.tokens)
        if self.usage_key in data:
            self.usage = usage_counts(data) or self.usage

    def _end(self) -> None:
        conn = self.conn
        assert conn is not None
        self.outcome = "complete"
        conn.listener = None
        conn.pool.release(conn)


def token_events(data: bytes) -> int:
    """The events in ``data`` that carry a token: every ``data:`` line but the role chunk
    (chat), a finish chunk of its own (empty delta or text), the usage chunk (no choices) and
    ``[DONE]``; counted as tokens they over-charged every stream by up to four."""
    events = data.count(b"data:")
    if not events:
        return 0
    return events - (data.count(b'"role":"assistant"') + data.count(b'"delta":{}')
                     + data.count(b'"text":""') + data.count(b'"choices":[]')
                     + data.count(DONE_LINE))


def response_deltas(data: bytes) -> int:
    """The events in a Responses API stream's ``data`` that carry a token: its text deltas (its
    other events say where the answer is)."""
    return data.count(_TEXT_DELTA)


def usage_key(route: Route) -> bytes:
    """The member whose presence says an answer of ``route`` may carry its usage."""
    return b'"output_tokens"' if route == "responses" else b'"completion_tokens"'


def usage_counts(data: bytes) -> Usage | None:
    """(completion, prompt, cached prompt) tokens of the usage in ``data``, if it has one; the
    last two None where it does not say (cached: vLLM's
    ``usage.prompt_tokens_details.cached_tokens``, with ``--enable-prompt-tokens-details``)."""
    m = _COMPLETION_TOKENS.search(data)
    if m is None:
        return None
    p = _PROMPT_TOKENS.search(data)
    c = _CACHED_TOKENS.search(data) if b'"cached_tokens"' in data else None
    return int(m.group(1)), int(p.group(1)) if p else None, int(c.group(1)) if c else None


class Gather:
    """Collects a whole answer's stream from the connection's own callbacks, as ``Relay``
    relays one: the call's task is woken once, at the end, not for every socket read. Each read
    stamps the idle bound; the first is the engine's first token (``Call.first_token``)."""

    __slots__ = ("call", "conn", "dog", "end", "parts")

    def __init__(self, call: Call, dog: Watchdog, conn: Connection) -> None:
        self.call = call
        self.dog = dog
        self.conn = conn
        self.parts: list[bytes] = []
        self.end: asyncio.Future[None] = conn.loop.create_future()

    async def wait(self) -> list[bytes]:
        """The body's parts once it is complete; raises the connection's error."""
        conn = self.conn
        conn.listener = self.push
        try:
            self.push()  # anything already there
            await self.end
        finally:
            if conn.listener == self.push:
                conn.listener = None
        if conn.error is not None:
            raise conn.error
        if not conn.complete:
            raise UpstreamError("the upstream closed the connection")
        return self.parts

    def push(self) -> None:
        conn = self.conn
        data = conn.take()
        if data:
            dog = self.dog
            if not dog.delivered:
                self.call.first_token()
                dog.delivered = True
            dog.last = dog.loop.time()
            self.parts.append(data)
        ended = (conn.complete and not conn.parts) or conn.error is not None or conn.closed
        if ended and not self.end.done():
            self.end.set_result(None)

