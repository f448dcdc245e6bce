"""The few ASGI pieces both HTTP servers (the gateway and the vLLM stand-in) need.

No framework: a plain ASGI callable on uvicorn (uvloop + httptools) keeps the hot path to a
handful of function calls per request, which is what the gateway's overhead budget allows.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import msgspec

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Headers = list[tuple[bytes, bytes]]

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]

_json_encode = msgspec.json.Encoder().encode


class BodyTooLarge(Exception):
    pass


async def read_body(receive: Receive, limit: int) -> bytes:
    """The whole request body (one message in the common case, no copy)."""
    msg = await receive()
    body: bytes = msg.get("body", b"")
    if not msg.get("more_body", False):
        if len(body) > limit:
            raise BodyTooLarge
        return body
    parts = [body]
    size = len(body)
    while msg.get("more_body", False):
        msg = await receive()
        chunk = msg.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge
        parts.append(chunk)
    return b"".join(parts)


def header(scope: Scope, name: bytes) -> bytes | None:
    """A request header (``name`` lower-case, as ASGI delivers them)."""
    for k, v in scope["headers"]:
        if k == name:
            return bytes(v)
    return None


async def send_bytes(
    send: Send, status: int, body: bytes, headers: Headers | None = None
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": JSON_HEADERS if headers is None else headers,
        }
    )
    await send({"type": "http.response.body", "body": body})


async def send_json(send: Send, status: int, obj: Any, headers: Headers | None = None) -> None:
    hdrs = JSON_HEADERS if headers is None else JSON_HEADERS + headers
    await send_bytes(send, status, _json_encode(obj), hdrs)


def json_bytes(obj: Any) -> bytes:
    return _json_encode(obj)


class AsgiSink:
    """A response that an engine call writes into: status and headers once, then body parts.

    ``started`` tells whether the client has seen anything (after that, a request can no longer be
    pulled back or answered with an error status); ``complete`` that the last part was sent.
    """

    __slots__ = ("_send", "complete", "extra_headers", "started")

    def __init__(self, send: Send, extra_headers: Headers | None = None) -> None:
        self._send = send
        self.started = False
        self.complete = False
        self.extra_headers = extra_headers or []

    async def start(self, status: int, headers: Headers) -> None:
        self.started = True
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": headers + self.extra_headers if self.extra_headers else headers,
            }
        )

    async def send(self, data: bytes, more: bool = True) -> None:
        if self.complete:
            return
        if not more:
            self.complete = True
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def whole(self, status: int, body: bytes, headers: Headers) -> None:
        """A complete response in one go (errors)."""
        await self.start(status, headers)
        await self.send(body, False)


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


def cancel_quietly(task: asyncio.Task[Any] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
