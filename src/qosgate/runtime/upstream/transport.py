"""The upstream's HTTP/1.1 client: one kept-alive connection (``Connection``) and a pool of them
per upstream (``Pool``).

A lean client of its own (an ``asyncio.Protocol`` around httptools' C parser, the same parser
uvicorn uses), not aiohttp: the gateway relays every streamed event, and aiohttp's per-request and
per-chunk machinery (request/response objects, multidicts, stream readers, tracing hooks) cost
more CPU than the rest of the gateway together (``docs/experiments/gateway.md``). It speaks just
what an engine needs: a request written in one go (prebuilt head + body), the response parsed as
it arrives, and every body part received in one socket read handed on as one piece, so an
upstream write becomes one downstream write.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import cast
from urllib.parse import urlsplit

import httptools

IDLE_S = 30.0  # a pooled connection idle this long is closed
MAX_BUFFERED = 1 << 20  # response bytes held for a slow client before reading pauses


class UpstreamError(ConnectionError):
    """The upstream could not be reached, closed the connection early or sent broken HTTP."""


def refused_connection(exc: BaseException) -> bool:
    """Whether ``exc`` says the upstream could not be connected to at all (refused, or the
    connect timed out): the replica is unreachable, not merely failing."""
    return isinstance(exc, ConnectionRefusedError) or (
        isinstance(exc, UpstreamError) and "connect" in str(exc))


class Connection(asyncio.Protocol):
    """One kept-alive connection; one exchange (request, then its response) at a time.

    The parser's callbacks fill the exchange's state; ``data_received`` wakes the waiting call
    once per socket read, whatever number of body parts that read held.
    """

    def __init__(self, pool: Pool) -> None:
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
        # set while a streamed response is relayed from these callbacks (``relay.py``)
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
        if self.buffered > MAX_BUFFERED:
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


_LENGTH = b"Content-Length: "  # the end of every head ``Pool.head`` makes


def with_request_id(head: bytes, rid: str) -> bytes:
    """``head`` (``Pool.head``'s) naming the request to the engine: ``X-Request-Id``, which vLLM
    takes as its own request id (``chatcmpl-<id>``, ``cmpl-<id>``: in its log and the answer's
    ``id``), so one request can be followed from the gateway's log into the engine's."""
    return head[:-len(_LENGTH)] + b"X-Request-Id: " + rid.encode("latin-1") + b"\r\n" + _LENGTH


class Pool:
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
        self.idle: list[Connection] = []

    def head(self, method: str, path: str, json_body: bool = True) -> bytes:
        """A request's head up to (not including) the Content-Length value."""
        ctype = b"Content-Type: application/json\r\n" if json_body else b""
        return (
            f"{method} {self.prefix}{path} HTTP/1.1\r\nHost: {self.host_header}\r\n".encode()
            + ctype + self.auth + _LENGTH
        )

    async def _connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, proto = await loop.create_connection(
                    lambda: Connection(self), self.host, self.port, ssl=self.ssl,
                    server_hostname=self.host if self.tls else None,
                )
        except TimeoutError:
            raise UpstreamError("connect timed out") from None
        return proto

    def _take(self) -> Connection | None:
        idle = self.idle
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.closed:
                continue
            if now - conn.idle_since > IDLE_S:
                conn.close()
                continue
            conn.reused = True
            return conn
        return None

    def send_now(self, head: bytes, body: bytes) -> Connection | None:
        """Write a request at once on a kept-alive connection, if one is free (else None)."""
        conn = self._take()
        if conn is not None:
            conn.begin(head + str(len(body)).encode() + b"\r\n\r\n", body)
        return conn

    async def request(
        self,
        head: bytes,
        body: bytes,
        until: Callable[[Connection], Awaitable[None]] | None = None,
        sent: Connection | None = None,
    ) -> Connection:
        """Send a request and await ``until(conn)`` (by default: until the response headers are
        in); return the connection. On any failure the connection is closed. ``sent``: the
        request was already written on that (kept-alive) connection by ``send_now``.

        A kept-alive connection the upstream closed meanwhile (its keep-alive timeout) fails
        before any response byte arrives: the request is then sent once more, on a new one.
        """
        wait = until or Connection.wait_headers
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

    def release(self, conn: Connection) -> None:
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
            if now - conn.idle_since > IDLE_S:
                conn.close()
            else:
                keep.append(conn)
        self.idle = keep

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle = []


