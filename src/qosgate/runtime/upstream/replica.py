"""An OpenAI-compatible engine over HTTP (vLLM, SGLang, llama.cpp server, TGI): one replica.

One pool of kept-alive HTTP/1.1 connections per upstream. The client's body is forwarded byte for
byte except the top-level ``priority``, which is set to qosgate's order for the request (its band,
then its rank in the band: ``core/engine_order.py``) in the engine's own polarity
(``priority_polarity``), or removed for engines that do not schedule by priority: see
``wire/splice.py`` for the polarities (with the vLLM/SGLang sources cited). A client that
did not ask for a stream has the engine asked for one all the same (``stream`` and
``stream_options.include_usage`` set), and gets the whole answer assembled from it
(``wire/assemble.py``): so that the first-byte and idle bounds, and TTFT, hold for it too.

Pulling a request back or a client leaving cancels the call, which closes its connection: vLLM and
SGLang abort a request whose client disconnected.

The HTTP client is a lean one of its own (an ``asyncio.Protocol`` around httptools' C parser, the
same parser uvicorn uses), not aiohttp: the gateway relays every streamed event, and aiohttp's
per-request and per-chunk machinery (request/response objects, multidicts, stream readers, tracing
hooks) cost more CPU than the rest of the gateway together (``docs/gateway.md``, "Measured"). It
speaks just what an engine needs: a request written in one go (prebuilt head + body), the response
parsed as it arrives, and every body part received in one socket read handed on as one piece, so
an upstream write becomes one downstream write. A streamed response is relayed from the
connection's own callbacks (``_Relay``): a chunk is written to the client in the callback that
read it, not a loop turn later by the call's task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Coroutine, Generator
from typing import Any, Literal, cast
from urllib.parse import urlsplit

import httptools
import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator

from qosgate.core.signals import LoadSignals
from qosgate.runtime.ports import Call, Health, Withdrawn
from qosgate.wire.assemble import StreamAssembler
from qosgate.wire.embeddings import apportion, deliver, pooled
from qosgate.wire.engine_metrics import parse_engine_metrics
from qosgate.wire.errors import error_json
from qosgate.wire.job import Job, Route, Unservable
from qosgate.wire.responses import model_card
from qosgate.wire.splice import (
    Polarity,
    PriorityOrder,
    engine_priority,
    set_priority,
    set_streamed,
)

log = logging.getLogger("qosgate.upstream")

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions",
          "embeddings": "/v1/embeddings"}
_IDLE_S = 30.0  # a pooled connection idle this long is closed
_MAX_BUFFERED = 1 << 20  # response bytes held for a slow client before reading pauses
_SSE_CACHE = (b"cache-control", b"no-cache")


class UpstreamSettings(BaseModel):
    """One upstream replica (an entry of the config's ``upstreams`` list)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    name: str | None = None
    capacity: int = Field(default=64, ge=1, description="in-flight window at this replica")
    priority_polarity: Polarity = Field(
        default="none",
        description="vllm: smaller runs first (needs --scheduling-policy priority); "
        "sglang: larger runs first (needs --enable-priority-scheduling); none: strip it",
    )
    priority_order: PriorityOrder = Field(
        default="full",
        description="full: the priority carries qosgate's whole order (band, then the rank "
        "in it: tenant fair share, deadline or arrival), so what waits in the engine's queue "
        "waits in qosgate's order; class: the band alone (0, 1, 2, ...), for an engine or a "
        "router in between that reads the priority as a small class number",
    )
    api_key: str | None = None
    models: tuple[str, ...] = Field(
        default=(), description="model ids served; empty = ask the upstream's /v1/models"
    )
    connect_timeout_s: float = Field(default=5.0, gt=0)
    idle_timeout_s: float = Field(
        default=60.0, gt=0, description="silence between streamed chunks that ends a request"
    )
    total_timeout_s: float = Field(default=900.0, gt=0, description="one engine call at most")
    probe_timeout_s: float = Field(default=5.0, gt=0, description="one health probe at most")
    scrape_metrics: bool = Field(
        default=True, description="read the engine's /metrics on every probe (its queue, KV "
        "use, preemptions: the adaptive window and the least-load router use them)"
    )
    engine: Literal["vllm", "sglang", "llamacpp"] | None = Field(
        default=None, description="whose metric names to read; None = whichever are there"
    )

    @field_validator("url")
    @classmethod
    def _url_ok(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"upstream url must start with http:// or https://, got {v!r}")
        return v.rstrip("/").removesuffix("/v1")


# ---------------------------------------------------------------------- the HTTP client
class UpstreamError(ConnectionError):
    """The upstream could not be reached, closed the connection early or sent broken HTTP."""


class _Conn(asyncio.Protocol):
    """One kept-alive connection; one exchange (request, then its response) at a time.

    The parser's callbacks fill the exchange's state; ``data_received`` wakes the waiting call
    once per socket read, whatever number of body parts that read held.
    """

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool
        self.loop = asyncio.get_running_loop()  # once: each lookup is a getpid() on 3.11
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.reused = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.busy = False
        self.got_bytes = False
        self.status = 0
        self.content_type: bytes | None = None
        self.retry_after: bytes | None = None
        self.headers_done = False
        self.until_eof = True  # neither Content-Length nor chunked: the body ends at EOF
        self.complete = False
        self.keep_alive = False
        self.error: BaseException | None = None
        self.parts: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None
        # set while a streamed response is relayed from these callbacks (see _Relay)
        self.listener: Callable[[], None] | None = None

    # ---- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        if not self.busy:  # bytes nobody asked for: the connection cannot be trusted
            self.close()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = UpstreamError(f"invalid HTTP response: {exc}")
            self.close()
        if self.buffered > _MAX_BUFFERED:
            self.pause()
        if self.listener is not None:
            self.listener()
        else:
            self._wake()

    def eof_received(self) -> bool | None:
        return False  # close our side too; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.busy and not self.complete and self.error is None:
            if self.headers_done and self.until_eof:
                self.complete = True  # a body delimited by the end of the connection
            else:
                self.error = UpstreamError(
                    "the upstream closed the connection" + (f": {exc}" if exc else "")
                )
        if self.listener is not None:
            self.listener()
        else:
            self._wake()

    # ---- httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-type":
            self.content_type = value
        elif n == b"retry-after":
            self.retry_after = value
        elif n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
            self.until_eof = False

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status < 200:  # 1xx: an interim response, the real one follows
            self.content_type = None
            self.until_eof = True
            return
        self.headers_done = True
        if self.status in (204, 304):
            self.until_eof = False

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        if self.headers_done:
            self.complete = True
            self.keep_alive = self.parser.should_keep_alive()

    # ---- the exchange
    def pause(self) -> None:
        if not self.paused and not self.closed and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and not self.closed and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()

    def take(self) -> bytes:
        """The body bytes received so far, as one piece (b"" if none)."""
        parts = self.parts
        if not parts:
            return b""
        self.parts = []
        self.buffered = 0
        self.resume()
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def begin(self, request: bytes, body: bytes) -> None:
        self._reset()
        self.busy = True
        assert self.transport is not None
        if len(body) < 65536:
            self.transport.write(request + body)
        else:
            self.transport.write(request)
            self.transport.write(body)

    async def wait_headers(self) -> None:
        while not self.headers_done:
            if self.error is not None:
                raise self.error
            if self.closed:
                raise UpstreamError("the upstream closed the connection")
            await self._wait()

    async def read_some(self) -> bytes:
        """The body bytes received so far (one piece), b"" once the response is complete."""
        while not self.parts:
            if self.error is not None:
                raise self.error
            if self.complete:
                return b""
            await self._wait()
        return self.take()

    async def read_all(self) -> bytes:
        out: list[bytes] = []
        while True:
            data = await self.read_some()
            if not data:
                return b"".join(out)
            out.append(data)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class _Pool:
    """Kept-alive connections to one upstream, the most recently used first."""

    def __init__(self, url: str, connect_timeout_s: float, api_key: str | None) -> None:
        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.tls = u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        host = f"[{self.host}]" if ":" in self.host else self.host
        default_port = self.port == (443 if self.tls else 80)
        self.host_header = host if default_port else f"{host}:{self.port}"
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if self.tls else None
        self.connect_timeout_s = connect_timeout_s
        self.auth = f"Authorization: Bearer {api_key}\r\n".encode() if api_key else b""
        self.idle: list[_Conn] = []

    def head(self, method: str, path: str, json_body: bool = True) -> bytes:
        """A request's head up to (not including) the Content-Length value."""
        ctype = b"Content-Type: application/json\r\n" if json_body else b""
        return (
            f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n".encode()
            + ctype + self.auth + b"Content-Length: "
        )

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, proto = await loop.create_connection(
                    lambda: _Conn(self), self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.tls else None,
                )
        except TimeoutError:
            raise UpstreamError("connect timed out") from None
        return proto

    def _take(self) -> _Conn | None:
        idle = self.idle
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if now - conn.idle_since > _IDLE_S:
                conn.close()
                continue
            conn.reused = True
            return conn
        return None

    def send_now(self, head: bytes, body: bytes) -> _Conn | None:
        """Write a request at once on a kept-alive connection, if one is free (else None)."""
        conn = self._take()
        if conn is not None:
            conn.begin(head + str(len(body)).encode() + b"\r\n\r\n", body)
        return conn

    async def request(
        self,
        head: bytes,
        body: bytes,
        until: Callable[[_Conn], Awaitable[None]] | None = None,
        sent: _Conn | None = None,
    ) -> _Conn:
        """Send a request and await ``until(conn)`` (by default: until the response headers are
        in); return the connection. On any failure the connection is closed. ``sent``: the
        request was already written on that (kept-alive) connection by ``send_now``.

        A kept-alive connection the upstream closed meanwhile (its keep-alive timeout) fails
        before any response byte arrives: the request is then sent once more, on a new one.
        """
        wait = until or _Conn.wait_headers
        request = head + str(len(body)).encode() + b"\r\n\r\n"
        conn = sent if sent is not None else self._take()
        if conn is not None:
            try:
                if sent is None:
                    conn.begin(request, body)
                await wait(conn)
                return conn
            except UpstreamError:
                conn.close()
                if conn.got_bytes:
                    raise
            except BaseException:
                conn.close()
                raise
        conn = await self._connect()
        try:
            conn.begin(request, body)
            await wait(conn)
        except BaseException:
            conn.close()
            raise
        return conn

    def release(self, conn: _Conn) -> None:
        """Back to the pool if the exchange ended cleanly, else closed."""
        if conn.complete and conn.keep_alive and not conn.closed and not conn.parts:
            conn.busy = False
            conn.waiter = None
            conn.listener = None
            conn.idle_since = time.monotonic()
            self.idle.append(conn)
        else:
            conn.close()

    def prune(self) -> None:
        now = time.monotonic()
        keep = []
        for conn in self.idle:
            if conn.closed:
                continue
            if now - conn.idle_since > _IDLE_S:
                conn.close()
            else:
                keep.append(conn)
        self.idle = keep

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle = []


class _Relay:
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

    def __init__(self, call: Call, dog: _Watchdog) -> None:
        self.call = call
        self.dog = dog
        self.sink = call.sink
        self.task: asyncio.Task[Any] | None = None
        self.conn: _Conn | None = None

    def counts(self) -> tuple[int, int | None]:
        if self.usage is not None:
            return self.usage
        return self.tokens, None

    async def run(self, conn: _Conn) -> None:
        """Relay ``conn``'s response (its request just sent) until it ends; raises its error."""
        self.conn = conn
        self.task = asyncio.current_task(conn.loop)
        self.first = True
        self.tokens = 0  # data events that carry a token (see _count)
        self.usage: tuple[int, int | None] | None = None
        self.outcome: str | None = None  # "complete" | "status"
        self.exc: BaseException | None = None
        self.stalled: tuple[Coroutine[Any, Any, None], Any] | None = None
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
                    coro, awaited = self.stalled
                    await _finish(coro, awaited)
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
                self.stalled[0].close()

    def _yield_turn(self) -> None:
        if not self.turn.done():
            self.turn.set_result(None)

    def _drive(self, coro: Coroutine[Any, Any, None]) -> bool:
        """Run a sink call as far as it goes now; True if it must wait (the task finishes it)."""
        try:
            awaited = coro.send(None)
        except StopIteration:
            return False
        self.stalled = (coro, awaited)
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
            while True:
                data = conn.take()
                last = conn.complete and not conn.parts
                if not data and not last:
                    if conn.error is not None:
                        self._yield_turn()
                    return
                if self.first:
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
        events = _token_events(data)
        if events > 0:
            self.tokens += events
            self.call.progress(self.tokens)
        if b'"completion_tokens"' in data:
            self.usage = _usage(data) or self.usage

    def _end(self) -> None:
        conn = self.conn
        assert conn is not None
        self.outcome = "complete"
        conn.listener = None
        conn.pool.release(conn)


def _token_events(data: bytes) -> int:
    """The events in ``data`` that carry a token: every ``data:`` line but the role chunk
    (chat), a finish chunk of its own (empty delta or text), the usage chunk (no choices) and
    ``[DONE]``; counted as tokens they over-charged every stream by up to four."""
    events = data.count(b"data:")
    if not events:
        return 0
    return events - (data.count(b'"role":"assistant"') + data.count(b'"delta":{}')
                     + data.count(b'"text":""') + data.count(b'"choices":[]')
                     + data.count(b"data: [DONE]"))


def _usage(data: bytes) -> tuple[int, int | None] | None:
    """(completion, prompt) tokens of the usage in ``data``, if it has one."""
    m = _COMPLETION_TOKENS.search(data)
    if m is None:
        return None
    p = _PROMPT_TOKENS.search(data)
    return int(m.group(1)), int(p.group(1)) if p else None


class _Gather:
    """Collects a whole answer's stream from the connection's own callbacks, as ``_Relay``
    relays one: the call's task is woken once, at the end, not for every socket read. Each read
    stamps the idle bound; the first is the engine's first token (``Call.first_token``)."""

    __slots__ = ("call", "conn", "dog", "end", "parts")

    def __init__(self, call: Call, dog: _Watchdog, conn: _Conn) -> None:
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


class _Suspend:
    """``await _SUSPEND`` suspends once, a bare yield as ``asyncio.sleep(0)`` makes, with one
    generator frame instead of its two."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        yield


_SUSPEND = _Suspend()


async def _finish(coro: Coroutine[Any, Any, None], awaited: Any) -> None:
    """Go on with a coroutine that was run by hand up to a suspension, as its task would."""
    while True:
        try:
            if awaited is None:  # a bare yield: asyncio.sleep(0)
                await asyncio.sleep(0)
            else:  # a future, flagged as a task takes it: unflag it, as the task would
                awaited._asyncio_future_blocking = False
                await awaited
        except BaseException as exc:
            try:
                awaited = coro.throw(exc)
            except StopIteration:
                return
            continue
        try:
            awaited = coro.send(None)
        except StopIteration:
            return


_models_decoder = msgspec.json.Decoder()


def _error_status(call: Call, status: int, data: bytes, ctype: bytes | None,
                  retry_after: bytes | None) -> None:
    """An engine's error answer (status >= 400), before anything reached the client."""
    if status in (429, 503):  # back-pressure: cool this replica, try another
        call.attempt_failed(f"upstream_{status}", backpressure=True,
                            retry_after=_retry_after_s(retry_after))
    elif status >= 500:
        call.attempt_failed(f"upstream_{status}")
    else:  # the engine's judgement of the request itself: the client's answer
        call.refused(status, _error_body(status, data, ctype))


def _retry_after_s(value: bytes | None) -> float | None:
    """An HTTP ``Retry-After`` in seconds (the delta-seconds form; a date is not trusted)."""
    if value is None:
        return None
    try:
        secs = float(value.strip())
    except ValueError:
        return None
    return secs if secs >= 0 else None


def _error_body(status: int, data: bytes, ctype: bytes | None) -> bytes:
    """An engine's error body as the client gets it: passed on if it is already in OpenAI's
    format, else wrapped in it (an HTML 500 page is no answer for an OpenAI client)."""
    if ctype is not None and b"json" in ctype.lower():
        try:
            doc = msgspec.json.decode(data)
        except msgspec.DecodeError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            return data
        if isinstance(doc, dict) and isinstance(doc.get("message"), str):  # FastAPI-style
            text = doc["message"]
        elif isinstance(doc, dict) and "detail" in doc:
            text = str(doc["detail"])
        else:
            text = data.decode("utf-8", "replace")[:500]
    else:
        text = data.decode("utf-8", "replace")[:500]
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return error_json(f"The engine answered {status}: {text.strip()}", kind, status)


class _Watchdog:
    """One timer per engine call for its time bounds: the first byte to the client, silence
    between streamed chunks, and the whole call. It re-arms itself lazily (a chunk only stamps
    ``last``; the first byte only sets ``delivered``), and on expiry cancels the call's task with
    ``fired`` naming the bound. Until the first byte it also wakes every ``idle_s``, so that
    once the first byte is out the idle bound holds from then on, however far off the
    first-byte bound was (an offline class's is ~50 minutes by default)."""

    __slots__ = ("delivered", "fired", "first_at", "handle", "idle_s", "last", "loop", "task",
                 "total_at")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], first_byte_s: float,
        idle_s: float, total_s: float,
    ) -> None:
        now = loop.time()
        self.loop = loop
        self.task = task
        self.first_at = now + first_byte_s
        self.total_at = now + total_s
        self.idle_s = idle_s
        self.last = now
        # the first byte is out: to the client (a stream), or, for a client that gets its
        # answer whole, from the engine; the idle bound holds from then on
        self.delivered = False
        self.fired: str | None = None
        self.handle = loop.call_at(min(self.first_at, self.total_at, now + idle_s), self._check)

    def _check(self) -> None:
        now = self.loop.time()
        if now >= self.total_at:
            self._fire("total_timeout")
        elif not self.delivered:
            if now >= self.first_at:
                self._fire("first_byte_timeout")
            else:
                self.handle = self.loop.call_at(
                    min(self.first_at, self.total_at, now + self.idle_s), self._check)
        elif now - self.last >= self.idle_s:
            self._fire("idle_timeout")
        else:
            self.handle = self.loop.call_at(min(self.total_at, self.last + self.idle_s),
                                            self._check)

    def _fire(self, reason: str) -> None:
        self.fired = reason
        if not self.task.done():
            self.task.cancel()

    def stop(self) -> None:
        self.handle.cancel()


class OpenAIUpstream:
    pausable = False
    embeds = True  # /v1/embeddings is forwarded (merged into batches)

    def __init__(self, cfg: UpstreamSettings, index: int = 0) -> None:
        self.cfg = cfg
        self.name = cfg.name or f"upstream-{index}"
        self.capacity = cfg.capacity
        self.polarity: Polarity = cfg.priority_polarity
        self.priority_order: PriorityOrder = cfg.priority_order
        # its queue runs in the order sent only where a polarity is sent, and only in full
        self.ordered = self.polarity != "none" and self.priority_order == "full"
        self.base = cfg.url
        self._models: list[str] = list(cfg.models)
        self._pool = _Pool(cfg.url, cfg.connect_timeout_s, cfg.api_key)
        self._heads = {route: self._pool.head("POST", path) for route, path in _PATHS.items()}
        self._models_head = self._pool.head("GET", "/v1/models", json_body=False)
        self._metrics_head = self._pool.head("GET", "/metrics", json_body=False)
        self._healthy = False
        self._cards: list[dict[str, Any]] = []
        self._created = int(time.time())

    # ------------------------------------------------------------------ life
    @property
    def ready(self) -> bool:
        return self._healthy

    def check_body(self, body: bytes, route: Route) -> Unservable | None:
        return None  # the engine itself judges what it receives

    def models(self) -> list[str]:
        return list(self._models)

    def model_cards(self) -> list[dict[str, Any]]:
        """The engine's own ``/v1/models`` entries (its last answer); a configured model it
        does not list gets a bare entry."""
        listed = {m["id"]: m for m in self._cards}
        return [listed.get(mid) or model_card(mid, "upstream", None, self._created)
                for mid in self._models]

    async def start(self) -> None:
        return None  # nothing to open: the driver probes every replica at start-up

    async def close(self) -> None:
        self._pool.close()

    async def probe(self) -> Health:
        """``GET /v1/models`` within the probe timeout; learns the model ids if none were
        configured. Never raises: anything but a 200 in time is ``up=False``."""
        conn: _Conn | None = None
        self._pool.prune()
        try:
            async with asyncio.timeout(self.cfg.probe_timeout_s):
                conn = await self._pool.request(self._models_head, b"")
                data = await conn.read_all()
            ok = conn.status == 200
            self._pool.release(conn)
            conn = None
            if ok:
                listed = _models_decoder.decode(data)
                cards = [m for m in listed.get("data", [])
                         if isinstance(m, dict) and isinstance(m.get("id"), str)]
                if self.cfg.models:  # configured: those, as the engine lists them if it does
                    cards = [m for m in cards if m["id"] in self.cfg.models]
                elif cards:
                    self._models = [m["id"] for m in cards]
                if cards:
                    self._cards = cards
        except (TimeoutError, OSError, ValueError, KeyError, TypeError, AttributeError):
            ok = False
        finally:
            if conn is not None:
                conn.close()
        self._healthy = ok
        signals = await self._scrape() if ok and self.cfg.scrape_metrics else None
        return Health(up=ok, models=tuple(self._models) if self._models else None,
                      signals=signals)

    async def _scrape(self) -> LoadSignals | None:
        """The engine's load from its ``/metrics`` (None if it has none or it fails). Stamped
        with time 0: the driver stamps it with its own clock when it hands it to the core."""
        conn: _Conn | None = None
        try:
            async with asyncio.timeout(self.cfg.probe_timeout_s):
                conn = await self._pool.request(self._metrics_head, b"")
                data = await conn.read_all()
            status = conn.status
            self._pool.release(conn)
            conn = None
            if status != 200:
                return None
            sig = parse_engine_metrics(data.decode("utf-8", "replace"), 0.0, self.cfg.engine)
        except (TimeoutError, OSError, ValueError):
            return None
        finally:
            if conn is not None:
                conn.close()
        empty = (sig.running, sig.waiting, sig.kv_usage, sig.preemptions_total)
        return None if empty == (None, None, None, None) else sig

    async def check(self) -> bool:
        return (await self.probe()).up

    # ------------------------------------------------------------------ one call
    def body_for(self, call: Call) -> bytes:
        """The body sent to the engine: the client's, with the engine-side ``priority``; for a
        client that wants its answer whole, asking for a stream with its usage (assembled back
        by ``_whole``). A streamed client's body asks for what it asked for: a usage chunk it
        did not ask for would reach it, and vLLM then moves ``system_fingerprint`` from the
        finish chunk to the usage chunk."""
        job: Job = call.job
        value = engine_priority(self.polarity, call.order(), call.levels(), self.priority_order)
        body = set_priority(job.body, value, job.has_priority)
        return body if job.stream else set_streamed(body)

    def pause(self, rid: str) -> None:  # pragma: no cover - not pausable: never asked
        raise NotImplementedError

    def resume(self, rid: str) -> None:  # pragma: no cover
        raise NotImplementedError

    async def run(self, call: Call) -> None:
        await self._run(call, None, None)

    def start_call(self, call: Call) -> Coroutine[Any, Any, None]:
        """``run(call)``, for the driver to make a task of, with its request written *now*.

        While the scheduler dispatches the request, if a kept-alive connection is free, the
        request goes out at once: not a loop turn later when the call's task first runs (which,
        under load, is behind a burst of relayed tokens: 0.2 ms at the median, 1-2 ms at p90).
        The coroutine is started up to a first suspension that closes that connection if the
        call is cancelled before its task ever ran (the engine aborts).
        Only a task can drive it (``await`` refuses a coroutine started this way).
        """
        sent: _Conn | None = None
        body: bytes | None = None
        try:
            body = self.body_for(call)
            sent = self._pool.send_now(self._heads[call.job.route], body)
        except Exception:  # raised again by the task, where it is reported as before
            body = None
        coro = self._run(call, body, sent)
        if sent is not None:
            coro.send(None)  # to the first suspension: the ``try`` below is entered
        return coro

    # ------------------------------------------------------------------ embeddings
    async def run_batch(self, calls: list[Call]) -> None:
        """Serve a batch of embeddings requests (``runtime/batches.py``): those that can share
        an upstream call (same model, dimensions and kind of input) go as one
        ``/v1/embeddings`` with their inputs in one list; the answer is split back, each client
        its own vectors in order and its share of the usage."""
        groups: dict[tuple[str, int | None, bool], list[Call]] = {}
        for c in calls:
            j = c.job
            kind = bool(j.inputs) and isinstance(j.inputs[0], list)  # type: ignore[index]
            groups.setdefault((j.model, j.dimensions, kind), []).append(c)
        await asyncio.gather(*(self._embed(g) for g in groups.values()))

    async def _embed(self, calls: list[Call]) -> None:
        first = calls[0].job
        inputs: list[Any] = []
        for c in calls:
            inputs.extend(c.job.inputs or [])
        req: dict[str, Any] = {"model": first.model, "input": inputs, "encoding_format": "float"}
        if first.dimensions is not None:
            req["dimensions"] = first.dimensions
        conn: _Conn | None = None
        try:
            async with asyncio.timeout(self.cfg.total_timeout_s):
                conn = await self._pool.request(self._heads["embeddings"],
                                                msgspec.json.encode(req))
                data = await conn.read_all()
            status = conn.status
            ctype = conn.content_type or b"application/json"
            retry_after = conn.retry_after
            self._pool.release(conn)
            conn = None
        except (TimeoutError, OSError) as exc:
            log.warning("upstream %s: embeddings: %s", self.base, exc)
            if conn is not None:
                conn.close()
            refused = isinstance(exc, ConnectionRefusedError) or (
                isinstance(exc, UpstreamError) and "connect" in str(exc))
            reason = ("first_byte_timeout" if isinstance(exc, TimeoutError) else
                      "upstream_unreachable")
            for c in calls:
                c.attempt_failed(reason, unreachable=refused)
            return
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        if status >= 400:
            if status in (429, 503):
                for c in calls:
                    c.attempt_failed(f"upstream_{status}", backpressure=True,
                                     retry_after=_retry_after_s(retry_after))
            elif status >= 500:
                for c in calls:
                    c.attempt_failed(f"upstream_{status}")
            elif len(calls) == 1:
                calls[0].refused(status, _error_body(status, data, ctype))
            else:  # one of them is at fault: each on its own, to answer each as it deserves
                await asyncio.gather(*(self._embed([c]) for c in calls))
            return
        try:
            doc = msgspec.json.decode(data)
            rows = sorted(doc["data"], key=lambda r: r["index"])
            vectors = [pooled(r["embedding"]) for r in rows]
            if len(vectors) != len(inputs):
                raise ValueError("wrong number of embeddings")
            usage = doc.get("usage") or {}
            total = usage.get("prompt_tokens")
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            log.warning("upstream %s: embeddings answer unreadable: %s", self.base, exc)
            for c in calls:
                c.attempt_failed("upstream_bad_response")
            return
        weights = [c.job.prompt_tokens for c in calls]
        shares = apportion(int(total), weights) if isinstance(total, int) else weights
        model = doc.get("model") or first.model
        at = 0
        for c, share in zip(calls, shares, strict=True):
            n = len(c.job.inputs or [])
            await deliver(c, model, vectors[at:at + n], share)
            at += n

    async def _whole(self, call: Call, conn: _Conn, dog: _Watchdog, body: bytes) -> None:
        """Read the engine's stream to its end and answer the client once, whole.

        The first-byte bound is met by the engine's first byte, and the idle bound holds
        between its chunks; the engine's first token is the request's TTFT (``first_token``).
        The client's bytes leave only at the end: the answer assembled from the events
        (``wire/assemble.py``). Only then is the core told of a first byte, so until then a
        failed call is an attempt the core may retry elsewhere, and the request can be pulled
        back: nothing reached its client. An error event is handled as that error status (a
        5xx is an attempt the core may retry, a 4xx the client's answer). An engine that
        answered whole anyway (no event stream) is passed on as it is."""
        parts = await _Gather(call, dog, conn).wait()
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if conn.content_type is not None and b"event-stream" in conn.content_type:
            status, answer = StreamAssembler(call.job.route, body).result_of(data)
        else:
            status, answer = conn.status, data
        tokens = max(0, _token_events(data))
        usage = _usage(data) if b'"completion_tokens"' in data else None
        if status >= 400:
            # an error event in the stream (or no answer in it): judged as the same error
            # status before the stream would be, as vLLM answers a whole request that fails
            _error_status(call, status, answer, b"application/json", None)
            return
        sink = call.sink
        # the core's first byte: raises Withdrawn if the request was pulled back meanwhile
        await sink.start(status, [(b"content-type", b"application/json")])
        await sink.send(answer, False)
        call.done(*(usage or (tokens, None)))

    async def _run(self, call: Call, body: bytes | None, sent: _Conn | None) -> None:
        job = call.job
        sink = call.sink
        conn: _Conn | None = sent
        cfg = self.cfg
        if sent is not None:
            try:
                await _SUSPEND  # where the eager start stops (see start_call)
            except BaseException:
                sent.close()  # cancelled before its task ran: the engine aborts
                raise
        # the call's own task: not before the suspension above, where an eager start still runs
        # in the task of whoever dispatched it (the watchdog would cancel that one)
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        # the engine is always asked for a stream (body_for), so the first-byte bound holds for
        # a client that wants its answer whole too: it is measured to the engine's first byte
        dog = _Watchdog(loop, task, job.first_byte_timeout_s, cfg.idle_timeout_s,
                        cfg.total_timeout_s)
        relay: _Relay | None = None
        try:
            if body is None:
                body = self.body_for(call)
            if job.stream:
                relay = _Relay(call, dog)
                conn = await self._pool.request(self._heads[job.route], body, relay.run, sent)
                if relay.outcome == "complete":
                    conn = None  # back in the pool (or closed) already
                    call.done(*relay.counts())
                    return
                # an error status: handled below
            else:
                conn = await self._pool.request(self._heads[job.route], body, None, sent)
            status = conn.status
            ctype = conn.content_type or b"application/json"
            if status >= 400:
                _error_status(call, status, await conn.read_all(), ctype, conn.retry_after)
                return
            if not job.stream:
                await self._whole(call, conn, dog, body)
                return  # the connection goes back to the pool below
        except Withdrawn:
            return  # pulled back meanwhile: nothing may reach the client
        except asyncio.CancelledError:
            reason = dog.fired
            if reason is None or task.uncancel() > 0:
                raise  # pulled back, client gone, or shutdown
            log.warning("upstream %s: %s for %s", self.base, reason, job.rid)
            if conn is not None:
                conn.close()
                conn = None
            if sink.started:
                call.timed_out(reason)
            else:
                call.attempt_failed(reason)
        except (TimeoutError, OSError) as exc:
            log.warning("upstream %s: %s", self.base, exc)
            got = conn is not None and conn.got_bytes
            if conn is not None:
                conn.close()
                conn = None
            if sink.started:
                call.failed("upstream_disconnected")
            else:
                refused = isinstance(exc, ConnectionRefusedError) or (
                    isinstance(exc, UpstreamError) and "connect" in str(exc)
                )
                if refused or not got:
                    reason = "upstream_unreachable"
                elif isinstance(exc, UpstreamError) and "invalid HTTP" in str(exc):
                    reason = "upstream_bad_response"  # garbled: it answered, not HTTP
                else:
                    reason = "upstream_disconnected"
                call.attempt_failed(reason, unreachable=refused)
        finally:
            dog.stop()
            if conn is not None:
                # cancelled, or left early: drop the connection so that the engine aborts at once
                if conn.complete and not conn.parts:
                    self._pool.release(conn)
                else:
                    conn.close()
