"""The gateway's HTTP/1.1 connections: uvicorn's httptools protocol with the guards it lacks.

uvicorn times out only an idle kept-alive connection. A client that connects and sends nothing,
or half a request head, or half a body, holds a socket (a file descriptor) and a parser forever:
a few hundred such sockets exhaust a process. This protocol adds, per connection:

- **a connection cap** (``max_connections``): a connection beyond it is answered at once with 503
  + ``Retry-After`` (OpenAI's error format, ``too_many_connections``) and closed, before the
  process runs out of descriptors;
- **a header timeout** (``header_timeout_s``): from the connection's opening (or the first byte of
  the next request on a kept-alive one) to the end of the request head. Past it the connection is
  closed, with 408 (``header_timeout``) if part of a head had arrived;
- **a header size cap** (``max_header_bytes``): 431 (``headers_too_large``);
- **a body timeout** (``body_timeout_s``): from the end of the head to the end of the body. Past
  it the request, which the app is reading, ends: the app sees ``BODY_TIMEOUT`` in its scope,
  answers 408 (``body_timeout``), counted as the request's outcome, and the connection closes.
  A file upload (``POST /v1/files``, up to hundreds of MB) is timed between its chunks instead:
  a slow link that keeps sending is not cut off, a silent one is;
- malformed HTTP is answered with a 400 in OpenAI's format (``invalid_http``) instead of
  uvicorn's plain text.

The refusals that happen before a request reaches the app are counted per reason in
``ConnectionStats`` (``qosgate_connections_refused_total{reason}``), beside the number of open
connections (``qosgate_open_connections``).

This subclasses uvicorn's ``HttpToolsProtocol`` and uses its per-connection state (``cycle``,
``connections``, ``transport``); tests/e2e/test_abuse.py exercises every path.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from prometheus_client.core import Metric
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from qosgate import metric_names as mn
from qosgate.server.asgi import BODY_TIMEOUT
from qosgate.wire.errors import error_json

# a timer firing this much after its time means the event loop was held up: grace before acting
_LATE_S = 0.1


# request bodies timed between their chunks, not as a whole (large uploads)
IDLE_TIMED_PATHS = frozenset({"/v1/files"})


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 10_000
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_header_bytes: int = 64 * 1024


class ConnectionStats:
    """Connections refused before a request reached the app, by reason, and the open ones."""

    def __init__(self) -> None:
        self.refused: Counter[str] = Counter()
        self.open = 0

    def collect(self) -> Iterator[Metric]:
        refused = mn.CONNECTIONS_REFUSED.counter()
        for reason in ("too_many_connections", "header_timeout", "headers_too_large",
                       "invalid_http"):
            refused.add_metric([reason], self.refused[reason])
        yield refused
        open_ = mn.OPEN_CONNECTIONS.gauge()
        open_.add_metric([], self.open)
        yield open_


def _status_line(status: int) -> bytes:
    phrases = {400: b"Bad Request", 408: b"Request Timeout", 431:
               b"Request Header Fields Too Large", 503: b"Service Unavailable"}
    return b"HTTP/1.1 %d %s\r\n" % (status, phrases.get(status, b""))


def error_response(status: int, code: str, message: str, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 response carrying an OpenAI error, closing the connection."""
    type_ = "overloaded_error" if status == 503 else (
        "timeout_error" if status == 408 else "invalid_request_error")
    body = error_json(message, type_, code)
    head = [
        _status_line(status),
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n",
    ]
    if retry_after is not None:
        head.append(b"retry-after: %d\r\n" % retry_after)
    return b"".join(head) + b"\r\n" + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """See the module doc. ``limits`` and ``stats`` are set on a subclass per server
    (``guarded_protocol``)."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()
    stats: ClassVar[ConnectionStats] = ConnectionStats()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._in_head = True  # waiting for (the rest of) a request head
        self._head_bytes = 0
        self._refused = False
        self._counted = False

    # ---------------------------------------------------------------- connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.stats.open += 1
        self._counted = True
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, "too_many_connections",
                         "The gateway has too many open connections; retry shortly.", 1)
            return
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted:
            self.stats.open -= 1
            self._counted = False
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        if self._refused or self.transport.is_closing():
            return
        if self._in_head:
            if self._head_bytes > self.limits.max_header_bytes:
                self._refuse(431, "headers_too_large",
                             f"The request head is over {self.limits.max_header_bytes} bytes.")
            return
        cycle = self.cycle
        if (
            self._body_timer is not None
            and cycle is not None
            and cycle.scope.get("path") in IDLE_TIMED_PATHS
        ):  # an upload: the timeout runs from its last chunk
            self._body_timer.cancel()
            self._body_timer = None
        if (
            self._body_timer is None
            and cycle is not None
            and cycle.more_body
            and not cycle.response_complete
        ):
            self._body_timer = self.loop.call_later(self.limits.body_timeout_s,
                                                    self._body_timed_out, self.loop.time())

    def send_400_response(self, msg: str) -> None:
        self._refuse(400, "invalid_http", "Invalid HTTP request.")

    # ---------------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:
        super().on_message_begin()
        if not self._in_head:
            self._in_head = True
            self._head_bytes = 0
        if self._head_timer is None:
            self._arm_head()

    def on_headers_complete(self) -> None:
        self._in_head = False
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # idle until the next request's first byte: uvicorn's keep-alive timeout applies
        if not self._in_head and self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    # ---------------------------------------------------------------- timers
    def _arm_head(self) -> None:
        self._head_timer = self.loop.call_later(self.limits.header_timeout_s,
                                                self._head_timed_out, self.loop.time())

    def _late(self, armed_at: float, timeout: float, retry: Callable[[], None]) -> bool:
        """True if the timer fires well after its time: the loop was held up (a burst of work,
        the CPU taken by others), and the client's bytes may be waiting unread -- libuv runs
        due timers before it reads. Then it is given one short grace, re-armed by ``retry``."""
        if self.loop.time() - (armed_at + timeout) > _LATE_S:
            handle = self.loop.call_later(_LATE_S, retry)
            if retry == self._head_grace:
                self._head_timer = handle
            else:
                self._body_timer = handle
            return True
        return False

    def _head_grace(self) -> None:
        self._head_timed_out(None)

    def _body_grace(self) -> None:
        self._body_timed_out(None)

    def _cancel_timers(self) -> None:
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None

    def _head_timed_out(self, armed_at: float | None) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if armed_at is not None and self._late(armed_at, self.limits.header_timeout_s,
                                               self._head_grace):
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # a response is still going out (a pipelined head behind it): wait for it
            self._arm_head()
            return
        if self._head_bytes:
            self._refuse(408, "header_timeout",
                         f"The request head did not arrive within "
                         f"{self.limits.header_timeout_s:g} s.")
        else:  # nothing was sent: nobody to answer
            self.stats.refused["header_timeout"] += 1
            self._refused = True
            self.transport.close()

    def _body_timed_out(self, armed_at: float | None) -> None:
        self._body_timer = None
        cycle = self.cycle
        if cycle is None or not cycle.more_body or cycle.response_complete:
            return
        if armed_at is not None and self._late(armed_at, self.limits.body_timeout_s,
                                               self._body_grace):
            return
        # the app, reading the body, wakes with what it has and the scope's flag; it answers 408
        # and the connection closes after that answer
        cycle.scope[BODY_TIMEOUT] = self.limits.body_timeout_s  # type: ignore[literal-required]
        cycle.keep_alive = False
        cycle.more_body = False
        cycle.message_event.set()
        self.flow.pause_reading()

    def _refuse(self, status: int, code: str, message: str, retry_after: int | None = None) -> None:
        self._refused = True
        self._cancel_timers()
        self.stats.refused[code] += 1
        if not self.transport.is_closing():
            self.transport.write(error_response(status, code, message, retry_after))
            self.transport.close()


def guarded_protocol(limits: ConnectionLimits, stats: ConnectionStats) -> type[GuardedHttpProtocol]:
    """The protocol class for one server (uvicorn's ``Config(http=...)``)."""
    return type("GatewayHttpProtocol", (GuardedHttpProtocol,),
                {"limits": limits, "stats": stats})
