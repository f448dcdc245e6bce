"""One OpenAI request's way through the gateway, from its body to its answer (``RequestFlow``).

A completion (``complete``) or an embeddings request (``embeddings``): key -> tenant (401), body
read within its limits (413/408), then every rule it meets before it queues (``prepare``: the
body, the model, the QoS hints, the session, the size limits), then the driver and the scheduler
(413/429/503/504 refusals). While it waits, its task watches the client and cancels the request
if the client goes away (queued: removed; running: aborted at the engine). Success bytes are
written by the engine call itself; what ended otherwise is answered here (``_conclude``).

Every request gets its id as it arrives: its answer names it (``x-qosgate-request-id``, and
``x-request-id`` as OpenAI's answers do), refusals included, the engine is sent it
(``X-Request-Id``), and the request log's line names it (``server/request_log.py``), written
here once per request where its one outcome is known.
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

from qosgate.config import QosConfig
from qosgate.core import QosInputError, Request, Scheduler, State
from qosgate.runtime.driver import Driver, Ticket
from qosgate.runtime.ports import Engine
from qosgate.runtime.precise import PreciseCache
from qosgate.server.allowance import allowance_headers
from qosgate.server.asgi import (
    AsgiSink,
    BodyTimeout,
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    read_body,
    send_bytes,
    wait_disconnect,
)
from qosgate.server.auth import RequestHeaders, client_request_id, denied_message, read_headers
from qosgate.server.errors import outcome_error, reason_error, retry_after_header
from qosgate.server.metrics import GatewayMetrics
from qosgate.server.prepare import NO_CLASS, Prepared, Refusal, Rules, prepare, prepare_embeddings
from qosgate.server.request_log import RequestLog
from qosgate.settings import GatewaySettings
from qosgate.wire.engine_request import Route
from qosgate.wire.sse import JSON_HEADERS, Headers, error_end

UNKNOWN_TENANT = "unknown"  # the tenant of a request whose key was refused
ARRIVAL = "qosgate.arrival"  # in the scope: the request's ``Arrival``


def id_headers(rid: str) -> Headers:
    """The response headers that name request ``rid``: the gateway's own, and OpenAI's
    ``x-request-id`` (which its clients report with an error)."""
    value = rid.encode()
    return [(b"x-qosgate-request-id", value), (b"x-request-id", value)]


@dataclass(slots=True)
class Arrival:
    """A request as it arrived: its id, its route, when, and the client's own X-Request-Id;
    ``logged`` once its line is written (one per request)."""

    rid: str
    route: str
    at: float
    client_id: str | None
    logged: bool = False


class RequestFlow:
    """Serves the completion and embeddings routes: admits each request, hands it to the driver,
    waits for its end while watching its client, and answers what the engine did not."""

    def __init__(
        self,
        cfg: QosConfig,
        settings: GatewaySettings,
        engines: dict[str, Engine],
        scheduler: Scheduler,
        driver: Driver,
        metrics: GatewayMetrics,
        models: Callable[[], list[str]],
        context: Callable[[str], int | None],
        precise: PreciseCache | None = None,
        request_log: RequestLog | None = None,
    ) -> None:
        self.cfg = cfg
        self.scheduler = scheduler
        self.driver = driver
        self.metrics = metrics
        self.clock = driver.clock
        self.precise = precise  # replicas whose index follows their engine's KV events
        self.request_log = request_log or RequestLog(settings.request_log)
        self.rules = Rules(cfg, settings, scheduler, engines, models, context,
                           driver.probe_interval_s)
        srv = settings.server
        self.max_body = srv.max_body_bytes
        self.body_timeout_s = srv.body_timeout_s
        self.sse_keepalive_s = srv.sse_keepalive_s
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(4).hex() + "-"
        self._session_key = self.rules.session_header.encode("latin-1")

    async def _refuse(
        self,
        send: Send,
        arrival: Arrival,
        reason: str,
        tenant: str,
        cls: str = NO_CLASS,
        message: str | None = None,
        headers: Headers | None = None,
        param: str | None = None,
    ) -> None:
        """Answer a request refused before it reached the scheduler, count it and log it."""
        self.metrics.refused(cls, tenant, reason)
        status, body = reason_error(reason, message, param)
        self._log_unqueued(arrival, tenant, cls, reason, status)
        out = JSON_HEADERS + id_headers(arrival.rid)
        await send_bytes(send, status, body, out + headers if headers else out)

    def _log_unqueued(self, arrival: Arrival, tenant: str, cls: str, reason: str,
                      status: int | None, outcome: str = "rejected") -> None:
        """The line of a request that ended before it reached the scheduler."""
        arrival.logged = True
        self.request_log.refused(arrival.rid, tenant, cls, arrival.route, reason, status,
                                 self.clock() - arrival.at, arrival.client_id, outcome)

    def _arrived(self, scope: Scope, heads: RequestHeaders, route: str, now: float) -> Arrival:
        arrival = Arrival(self.new_request_id(), route, now, client_request_id(heads.client_id))
        scope[ARRIVAL] = arrival  # for the app's last resort, a bug's answer (``internal_error``)
        return arrival

    async def complete(self, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
        now = self.clock()
        heads = read_headers(scope, self._session_key)
        arrival = self._arrived(scope, heads, route, now)
        got = await self._tenant_and_body(scope, receive, send, heads.api_key, arrival)
        if got is None:
            return
        tenant, body = got
        ready = prepare(heads, body, route, arrival.rid, now, self.rules)
        precise = self.precise
        if precise is not None and isinstance(ready, Prepared) and self.scheduler.reads_prefix:
            # the prompt's keys from its token ids, as the engines' KV events name blocks (else
            # its text's stand)
            keys = await precise.prefix_of(body, route, ready.engine_request.model)
            if keys is not None:
                ready.req.prefix = keys
        await self._serve(receive, send, tenant, ready, arrival)

    async def embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/embeddings``: classified, admitted and queued as a completion is; once
        dispatched, collected by its replica's batcher and served in a batch."""
        now = self.clock()
        heads = read_headers(scope, self._session_key)
        arrival = self._arrived(scope, heads, "embeddings", now)
        got = await self._tenant_and_body(scope, receive, send, heads.api_key, arrival)
        if got is None:
            return
        tenant, body = got
        await self._serve(receive, send, tenant,
                          prepare_embeddings(heads, body, arrival.rid, now, self.rules), arrival)

    def new_request_id(self) -> str:
        return self._id_prefix + str(next(self._ids))

    async def _serve(
        self, receive: Receive, send: Send, tenant: str, ready: Prepared | Refusal, arrival: Arrival
    ) -> None:
        """Hand a prepared request to the driver and wait for its end while watching its client,
        then answer what the engine did not, and log it; or answer its refusal."""
        if isinstance(ready, Refusal):
            await self._refuse(
                send, arrival, ready.reason, tenant, ready.service_class, ready.message,
                None if ready.retry_after is None else retry_after_header(ready.retry_after),
                ready.param,
            )
            return
        req, engine_request = ready.req, ready.engine_request
        qos_headers = await self._qos_headers_unless_draining(send, tenant, req, arrival)
        if qos_headers is None:
            return
        if ready.inserted is not None:
            qos_headers.append((b"x-qosgate-inserted-max-tokens", str(ready.inserted).encode()))
        sink = AsgiSink(send, qos_headers)
        t = self.driver.ticket(req, engine_request, sink)
        self.driver.submit(t)
        # after admission (this request counted), before the engine's task can start the answer
        # (on a model the tenant has a limit on, of that limit where it binds first)
        sink.extra_headers += allowance_headers(
            self.scheduler.allowance(req.tenant, self.clock(), req.model))
        if not t.finished.done():
            keepalive = (self._keepalive(t, sink)
                         if engine_request.stream and self.sse_keepalive_s else None)
            try:
                await self._await_end(receive, t)
            finally:
                if keepalive is not None:
                    keepalive[0].cancel()
        await self._conclude(t)
        arrival.logged = True
        self.request_log.ended(req, arrival.route, sink.status, arrival.client_id)

    async def _qos_headers_unless_draining(
        self, send: Send, tenant: str, req: Request, arrival: Arrival
    ) -> Headers | None:
        """The response headers naming the request and its class; None once a draining gateway
        has refused it (503 with Retry-After)."""
        cls_header = (b"x-qosgate-class", req.service_class.encode())
        if not self.driver.accepting:
            await self._refuse(send, arrival, "shutting_down", tenant, req.service_class,
                               headers=[cls_header, *retry_after_header(None)])
            return None
        return [*id_headers(req.id), cls_header]

    async def _tenant_and_body(
        self, scope: Scope, receive: Receive, send: Send, key: str | None, arrival: Arrival
    ) -> tuple[str, bytes] | None:
        """The tenant of ``key`` and the request's body, read within its limits; None once the
        request has been answered (a bad key, a body too large or too slow) or its client left.
        The body is read even when the key is refused: an answer sent while the client is still
        sending would be lost to the connection's reset."""
        denied: QosInputError | None = None
        try:
            tenant_cfg = self.scheduler.classifier.tenant_for(key)
        except QosInputError as exc:
            denied, tenant_cfg = exc, None
        tenant = (UNKNOWN_TENANT if denied is not None else
                  tenant_cfg.name if tenant_cfg is not None else self.cfg.default_tenant)
        try:
            body = await read_body(receive, self.max_body, scope)
        except BodyTooLarge:
            await self._refuse(send, arrival, "body_too_large", tenant, message=(
                f"The request body is over the limit of {self.max_body} bytes."))
            return None
        except BodyTimeout:
            await self._refuse(send, arrival, "body_timeout", tenant, message=(
                "The request body did not arrive within "
                f"{self.body_timeout_s:g} s."),
                headers=[(b"connection", b"close")])
            return None
        except ClientGone:
            self.metrics.ended(NO_CLASS, tenant, "cancelled", "client_disconnected")
            self._log_unqueued(arrival, tenant, NO_CLASS, "client_disconnected", None, "cancelled")
            return None
        if denied is not None:
            await self._refuse(send, arrival, denied.code, tenant,
                               message=denied_message(denied, scope))
            return None
        return tenant, body

    def _keepalive(self, t: Ticket, sink: AsgiSink) -> list[asyncio.TimerHandle]:
        """Every ``sse_keepalive_s`` until the engine starts the response: the SSE head (once)
        and a ``: keep-alive`` comment, so that a queued stream's client does not time out."""
        loop = self.driver.loop()
        every = self.sse_keepalive_s

        def tick() -> None:
            if not t.finished.done() and sink.keepalive(loop):
                handle[0] = loop.call_later(every, tick)

        handle = [loop.call_later(every, tick)]
        return handle

    async def _await_end(self, receive: Receive, t: Ticket) -> None:
        """Wait for the request's end while watching its client, in this same task.

        ``receive()`` returns when the client goes away or once the response is complete. A
        request that ends otherwise (refused after queueing, timed out, failed before its
        response began) resolves ``t.finished``, whose callback wakes this task by cancelling it.
        (Not a second task per request to watch the client: its creation, first step and
        cancellation showed in the gateway's profile.)
        """
        task = asyncio.current_task(self.driver.loop())
        assert task is not None
        state = [True, False]  # [waiting in receive(), woken by the request's end]

        def wake(_: object) -> None:
            if state[0]:
                state[1] = True
                task.cancel()

        t.finished.add_done_callback(wake)
        try:
            await wait_disconnect(receive)
        except asyncio.CancelledError:
            state[0] = False
            if state[1] and task.uncancel() == 0:
                return  # woken: the request has ended
            # cancelled from outside: the server's shutdown ran out of time. End the request;
            # its client is answered (a stream: an error event and [DONE]) by _conclude
            self.driver.cancel(t, "server_shutdown")
            task.uncancel()
            return
        state[0] = False
        if not t.client.complete:  # the client went away
            self.driver.cancel(t, "client_disconnected")
        if not t.finished.done():  # the response is complete, its end about to be recorded
            try:
                await t.finished
            except asyncio.CancelledError:
                self.driver.cancel(t, "server_shutdown")
                task.uncancel()

    def internal_error(self, scope: Scope) -> Headers:
        """A bug ended the request (the app answers it 500): its line, unless it has one
        already; the headers naming it for that answer (none if the flow had not named it)."""
        arrival = scope.get(ARRIVAL)
        if not isinstance(arrival, Arrival):
            return []
        if not arrival.logged:
            self._log_unqueued(arrival, UNKNOWN_TENANT, NO_CLASS, "internal_error", 500)
        return id_headers(arrival.rid)

    async def _conclude(self, t: Ticket) -> None:
        """Answer a request that ended without a complete response."""
        sink = t.client
        assert isinstance(sink, AsgiSink)
        req = t.req
        if sink.complete:
            return
        if req.state is State.CANCELLED and req.reason == "client_disconnected":
            return  # nobody to answer
        if sink.started:  # the response broke off after it began: end it visibly
            if t.engine_request.stream:
                status, body, _ = outcome_error(req, self.cfg)
                await sink.send(error_end(body), False)
            else:
                await sink.send(b"", False)
            return
        if t.answer is not None and req.state is State.REJECTED:  # the engine's own 4xx
            status, body = t.answer
            await sink.whole(status, body, list(JSON_HEADERS))
            return
        status, body, extra = outcome_error(req, self.cfg)
        await sink.whole(status, body, [*JSON_HEADERS, *extra])
