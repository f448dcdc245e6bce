"""A gateway with its engine in this process, driven through its ASGI callable: no socket, no
child process, no start-up of an interpreter.

What a test of the gateway's own answers (errors, limits, metrics, streams from the built-in
simulated engine) needs is the app, not a server around it: the process tests in ``tests/e2e``
keep what only a real server or a real upstream shows (framing, connection limits, signals,
workers, an upstream's HTTP behaviour). Here the app runs on an event loop in a thread of the
test process, its lifespan started and stopped as uvicorn would; each request is one ASGI call,
its response streamed back chunk by chunk as the app sends it (an SSE stream arrives as it is
written, and closing it early is the client going away). The official ``openai`` client and a
raw ``http`` with ``tests.support.httpclient.http``'s signature both go through it.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Coroutine, Iterator
from types import TracebackType
from typing import Any, TypeVar

import httpx
import yaml
from openai import OpenAI

from qosgate.config import IO_SECTIONS, config_from_mapping
from qosgate.server.app import Gateway
from qosgate.server.compose import build_gateway
from qosgate.settings import settings_from_mapping

T = TypeVar("T")

TIME_SCALE = 0.05  # the simulated engine's modelled time, sped up unless the config says
WAIT_S = 60.0  # the longest a test waits for the app's next message


class InProcessGateway:
    """``qosgate serve`` with ``config`` (its YAML text), in this process. With no upstream, the
    engine is the simulated one (``engine.kind: sim``) at ``TIME_SCALE`` unless the config says
    otherwise; with no port in ``server``, batch jobs are kept in a temporary directory of their
    own (port 0), so gateways of one session never share one."""

    url = "http://gateway.test"

    def __init__(self, config: str = "") -> None:
        raw: dict[str, Any] = yaml.safe_load(config) or {}
        cfg = config_from_mapping({k: v for k, v in raw.items() if k not in IO_SECTIONS})
        io = {k: raw[k] for k in IO_SECTIONS if raw.get(k) is not None}
        io.setdefault("server", {}).setdefault("port", 0)
        if not io.get("upstreams"):
            engine = io.setdefault("engine", {})
            engine.setdefault("kind", "sim")
            engine.setdefault("time_scale", TIME_SCALE)
        settings = settings_from_mapping(io)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gateway", daemon=True)
        self._thread.start()
        self._lifespan: Lifespan | None = None
        try:
            self.gateway: Gateway = self._run(_built(cfg, settings))
            self._lifespan = Lifespan(self.gateway)
            self._run(self._lifespan.startup())
        except BaseException:
            self.close()
            raise
        self.transport = AppTransport(self.gateway, self.loop)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT_S)

    def client(self, key: str = "test", **kw: Any) -> OpenAI:
        """The official client, through the app (no retries: a test sees every answer)."""
        return OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0,
                      http_client=httpx.Client(transport=self.transport), **kw)

    def http(
        self,
        method: str,
        url: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 10,
    ) -> tuple[int, dict[str, str], bytes]:
        """A raw request: (status, lower-case headers, body), errors included."""
        with httpx.Client(transport=self.transport, timeout=timeout) as c:
            r = c.request(method, url, content=body, headers=headers)
            return r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content

    def close(self) -> None:
        """The lifespan's shutdown (as uvicorn's at SIGTERM, after the requests), then the loop."""
        if self._lifespan is not None:
            lifespan, self._lifespan = self._lifespan, None
            self._run(lifespan.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(WAIT_S)
        self.loop.close()

    def __enter__(self) -> InProcessGateway:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


async def _built(cfg: Any, settings: Any) -> Gateway:
    """Built on the gateway's own loop, as ``serve`` builds it on uvicorn's."""
    return build_gateway(cfg, settings)


class Lifespan:
    """The app's lifespan call, driven as a server drives it: startup, and later shutdown."""

    def __init__(self, app: Gateway) -> None:
        self.app = app
        self._task: asyncio.Task[None] | None = None
        self._inbox: asyncio.Queue[dict[str, Any]] | None = None
        self._outbox: asyncio.Queue[dict[str, Any]] | None = None

    async def _say(self, kind: str) -> dict[str, Any]:
        assert self._inbox is not None and self._outbox is not None
        await self._inbox.put({"type": kind})
        return await self._outbox.get()

    async def startup(self) -> None:
        self._inbox, self._outbox = asyncio.Queue(), asyncio.Queue()
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self._task = asyncio.ensure_future(self.app(scope, self._inbox.get, self._outbox.put))
        msg = await self._say("lifespan.startup")
        if msg["type"] != "lifespan.startup.complete":
            raise RuntimeError(f"the gateway did not start: {msg.get('message')}")

    async def shutdown(self) -> None:
        await self._say("lifespan.shutdown")
        assert self._task is not None
        await self._task


_END = object()  # the app's call returned


class Exchange:
    """One request to the app. Its messages come back through a thread-safe queue; the client
    going away (the response closed before its end) is ``http.disconnect``, as uvicorn says it,
    and so is the end of the response."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.messages: queue.Queue[Any] = queue.Queue()
        self._gone = asyncio.Event()

    async def run(self, app: Gateway, scope: dict[str, Any], body: bytes) -> None:
        body_left = True

        async def receive() -> dict[str, Any]:
            nonlocal body_left
            if body_left:
                body_left = False
                return {"type": "http.request", "body": body, "more_body": False}
            await self._gone.wait()
            return {"type": "http.disconnect"}

        async def send(msg: dict[str, Any]) -> None:
            if self._gone.is_set():
                return  # uvicorn drops what is sent to a client that went away
            self.messages.put(msg)
            if msg["type"] == "http.response.body" and not msg.get("more_body", False):
                self._gone.set()

        try:
            await app(scope, receive, send)  # type: ignore[arg-type]
        except BaseException as exc:  # the test sees it as the transport's error
            self.messages.put(exc)
        finally:
            self.messages.put(_END)

    def next(self, request: httpx.Request) -> Any:
        try:
            msg = self.messages.get(timeout=WAIT_S)
        except queue.Empty:
            raise httpx.ReadTimeout("the gateway sent nothing", request=request) from None
        if isinstance(msg, BaseException):
            raise httpx.RemoteProtocolError(f"the app failed: {msg!r}", request=request) from msg
        return msg

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self._gone.set)


class Body(httpx.SyncByteStream):
    """A response body as the app sends it, part by part."""

    def __init__(self, exchange: Exchange, request: httpx.Request) -> None:
        self.exchange = exchange
        self.request = request

    def __iter__(self) -> Iterator[bytes]:
        while True:
            msg = self.exchange.next(self.request)
            if msg is _END:
                return
            if msg["type"] != "http.response.body":
                continue
            if msg.get("body"):
                yield bytes(msg["body"])
            if not msg.get("more_body", False):
                return

    def close(self) -> None:
        self.exchange.close()


class AppTransport(httpx.BaseTransport):
    """httpx's transport into the app: one ``Exchange`` per request, the response returned at
    ``http.response.start`` and its body streamed after (httpx's own ``ASGITransport`` is async
    and holds the whole body back until the app is done)."""

    def __init__(self, app: Gateway, loop: asyncio.AbstractEventLoop) -> None:
        self.app = app
        self.loop = loop

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = request.read()
        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": request.method, "scheme": request.url.scheme,
            "path": request.url.path, "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query, "root_path": "",
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "client": ("127.0.0.1", 1), "server": (request.url.host, request.url.port or 80),
            "state": {},
        }
        exchange = asyncio.run_coroutine_threadsafe(_exchange(self.loop), self.loop).result()
        asyncio.run_coroutine_threadsafe(exchange.run(self.app, scope, body), self.loop)
        while True:
            msg = exchange.next(request)
            if msg is _END:  # the app returned without a response: uvicorn's 500
                return httpx.Response(500, content=b"Internal Server Error", request=request)
            if msg["type"] == "http.response.start":
                headers = [(bytes(k), bytes(v)) for k, v in msg.get("headers", [])]
                return httpx.Response(msg["status"], headers=headers,
                                      stream=Body(exchange, request), request=request)


async def _exchange(loop: asyncio.AbstractEventLoop) -> Exchange:
    """Made on the app's loop: its event belongs there."""
    return Exchange(loop)
