"""The few ASGI pieces both HTTP servers (the gateway and the vLLM stand-in) need.

No framework: a plain ASGI callable on uvicorn (uvloop + httptools) keeps the hot path to a
handful of function calls per request, which is what the gateway's overhead budget allows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

from qosgate.wire.errors import error_json
from qosgate.wire.sse import JSON_HEADERS, KEEPALIVE, SSE_HEADERS, Headers, error_end

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_json_encode = msgspec.json.Encoder().encode


class BodyTooLarge(Exception):
    pass


class ClientGone(Exception):
    """The client went away before its request body was complete."""


class BodyTimeout(Exception):
    """The body did not arrive in time (the server's protocol set ``BODY_TIMEOUT``)."""


BODY_TIMEOUT = "qosgate.body_timeout"  # in the scope: the body timed out (server/protocol.py)


async def read_body(receive: Receive, limit: int, scope: Scope | None = None) -> bytes:
    """The whole request body (one message in the common case, no copy). ``ClientGone`` if the
    client leaves first, ``BodyTimeout`` if the server gave up waiting for the rest."""
    msg = await receive()
    if msg["type"] != "http.request":
        raise ClientGone
    body: bytes = msg.get("body", b"")
    if not msg.get("more_body", False):
        if scope is not None and BODY_TIMEOUT in scope:
            raise BodyTimeout
        if len(body) > limit:
            raise BodyTooLarge
        return body
    parts = [body]
    size = len(body)
    while msg.get("more_body", False):
        msg = await receive()
        if msg["type"] != "http.request":
            raise ClientGone
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        parts.append(chunk)
    if scope is not None and BODY_TIMEOUT in scope:
        raise BodyTimeout
    return b"".join(parts)


def header(scope: Scope, name: bytes) -> bytes | None:
    """A request header (``name`` lower-case, as ASGI delivers them)."""
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v)
    return None


def _with_length(headers: Headers, n: int) -> Headers:
    return [*headers, (b"content-length", str(n).encode())]


async def send_bytes(
    send: Send, status: int, body: bytes, headers: Headers | None = None
) -> None:
    """A whole response, with ``Content-Length``."""
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": _with_length(JSON_HEADERS if headers is None else headers, len(body)),
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, obj: Any, headers: Headers | None = None) -> None:
    hdrs = JSON_HEADERS if headers is None else JSON_HEADERS + headers
    await send_bytes(send, status, _json_encode(obj), hdrs)


async def not_allowed(send: Send, method: str, path: str, allow: bytes) -> None:
    """405 for a known path asked with another method, with ``Allow`` (OpenAI's error body)."""
    await send_bytes(
        send, 405,
        error_json(f"Method {method} is not allowed on {path}; use {allow.decode()}.",
                   "invalid_request_error", "method_not_allowed"),
        [*JSON_HEADERS, (b"allow", allow)],
    )


def json_bytes(obj: Any) -> bytes:
    return _json_encode(obj)


class AsgiSink:
    """A response that an engine call writes into: status and headers once, then body parts.

    ``started`` tells whether the engine began its response (after that, a request can no longer
    be pulled back or answered with an error status); ``complete`` that the last part was sent.

    A response whose first part is also its last goes out with ``Content-Length`` (the head is
    held back until that first part). A streamed request that waits in the queue may get its
    head early (200, ``text/event-stream``) and SSE comments (``keepalive``), so that a client
    with a read timeout does not give up; ``head_sent`` says so. The engine's own ``start`` then
    sends nothing more, and an error it answers with, or the gateway's own error status, goes
    out as an SSE error event and ``[DONE]`` instead. ``status`` is the one the client got
    (None until the head left).
    """

    __slots__ = (
        "_error_parts", "_head", "_keepalive", "_send", "complete", "extra_headers", "head_sent",
        "started", "status",
    )

    def __init__(self, send: Send, extra_headers: Headers | None = None) -> None:
        self._send = send
        self.started = False
        self.complete = False
        self.head_sent = False
        self.status: int | None = None
        self.extra_headers = extra_headers or []
        self._head: tuple[int, Headers] | None = None  # held back until the first part
        self._error_parts: list[bytes] | None = None  # an error after an early head
        self._keepalive: asyncio.Task[None] | None = None

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        ka = self._keepalive
        if ka is not None and not ka.done():
            await ka
        if self.head_sent:
            if status >= 400:
                self._error_parts = []
            return
        self._head = (status, headers + self.extra_headers if self.extra_headers else headers)

    async def send(self, data: bytes, more: bool = True) -> None:
        if self.complete:
            return
        if not more:
            self.complete = True
        errors = self._error_parts
        if errors is not None:
            errors.append(data)
            if more:
                return
            data = error_end(b"".join(errors))
        head = self._head
        if head is not None:
            self._head = None
            status, headers = head
            self.status = status
            if not more:
                headers = _with_length(headers, len(data))
            await self._send({"type": "http.response.start", "status": status,
                              "headers": headers})
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def whole(self, status: int, body: bytes, headers: Headers) -> None:
        """A complete response in one go (errors)."""
        await self.start(status, headers)
        await self.send(body, False)

    def keepalive(self, loop: asyncio.AbstractEventLoop) -> bool:
        """While the engine has not started: send the SSE head (once) and a comment. False once
        the response is the engine's (or over): no more keep-alives."""
        if self.started or self.complete:
            return False
        ka = self._keepalive
        if ka is None or ka.done():
            self._keepalive = loop.create_task(self._keepalive_write())
        return True

    async def _keepalive_write(self) -> None:
        if self.started or self.complete:
            return
        if not self.head_sent:
            self.head_sent = True
            self.status = 200
            await self._send({"type": "http.response.start", "status": 200,
                              "headers": SSE_HEADERS + self.extra_headers})
        await self._send({"type": "http.response.body", "body": KEEPALIVE,
                          "more_body": True})


async def wait_disconnect(receive: Receive) -> None:
    """Return when the client goes away (or the response is complete: callers tell them apart)."""
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return


async def lifespan(
    receive: Receive,
    send: Send,
    startup: Callable[[], Awaitable[None]],
    shutdown: Callable[[], Awaitable[None]],
) -> None:
    while True:
        msg = await receive()
        if msg["type"] == "lifespan.startup":
            try:
                await startup()
            except Exception as exc:  # reported to uvicorn, which exits non-zero
                await send({"type": "lifespan.startup.failed", "message": repr(exc)})
                return
            await send({"type": "lifespan.startup.complete"})
        elif msg["type"] == "lifespan.shutdown":
            try:
                await shutdown()
            finally:
                await send({"type": "lifespan.shutdown.complete"})
            return

