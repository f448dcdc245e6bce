"""One OpenAI request's way through the gateway, from its body to its answer (``RequestFlow``).

A completion (``complete``) or an embeddings request (``embeddings``): key -> tenant (401), body
read with the fast partial parser (400), model (404), QoS inputs from the body (``priority``,
``latency_budget_ms``, ``task_type``, ``qos_class``) or the ``x-qos-class`` / ``x-qos-priority``
headers, the conversation it belongs to (the session header, ``fleet.cache.session_header``:
a bad value is a 400; else, with ``session_from_user``, the body's ``user``) and its prompt's
prefix keys (``wire.prefix``: where its prompt may be cached), then the scheduler
(413/429/503/504 refusals). While it waits, its task watches the
client and cancels the request if the client goes away (queued: removed; running: aborted at the
engine). Success bytes are written by the engine call itself; what ended otherwise is answered
here (``_conclude``).
"""

from __future__ import annotations

import asyncio
import itertools
import os
from collections.abc import Callable

import msgspec

from qosgate.config import QosConfig
from qosgate.core import QosInputError, QosInputs, Request, Scheduler, State
from qosgate.runtime.driver import Driver, Ticket
from qosgate.runtime.ports import Engine
from qosgate.runtime.precise import PreciseCache
from qosgate.server.asgi import (
    AsgiSink,
    BodyTimeout,
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    header,
    read_body,
    send_bytes,
    wait_disconnect,
)
from qosgate.server.auth import (
    denied_message,
    input_param,
    read_headers,
    request_key,
    session_id,
    session_message,
)
from qosgate.server.errors import outcome_error, reason_error, retry_after_header
from qosgate.server.metrics import GatewayMetrics
from qosgate.settings import GatewaySettings
from qosgate.wire.embeddings import BadEmbeddings, parse_embeddings
from qosgate.wire.engine_request import EngineRequest, Route
from qosgate.wire.parse import BadBody, estimate_how, estimate_prompt_tokens, parse_body, user_of
from qosgate.wire.prefix import body_prefix
from qosgate.wire.splice import set_member
from qosgate.wire.sse import JSON_HEADERS, Headers, error_end

NO_CLASS = "none"  # the class of a request refused before it had one
UNKNOWN_TENANT = "unknown"  # the tenant of a request whose key was refused


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
    ) -> None:
        self.cfg = cfg
        self.engines = engines
        self.scheduler = scheduler
        self.driver = driver
        self.metrics = metrics
        self.clock = driver.clock
        self.models = models  # the model ids served
        self.context = context  # a model's context length, as its engines report it
        self.precise = precise  # replicas whose index follows their engine's KV events
        srv = settings.server
        self.max_body = srv.max_body_bytes
        self.body_timeout_s = srv.body_timeout_s
        self.sse_keepalive_s = srv.sse_keepalive_s
        self.embeddings_settings = settings.embeddings
        self._first_byte_s = [c.first_byte_timeout for c in cfg.classes]
        # class names as clients may write them (x-qos-class: Realtime)
        self._class_names = {c.name.lower(): c.name for c in cfg.classes}
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(4).hex() + "-"
        cache = cfg.fleet.cache
        self.session_header = cache.session_header.lower()
        self._session_key = self.session_header.encode("latin-1")
        self.session_from_user = cache.session_from_user

    async def _refuse(
        self,
        send: Send,
        reason: str,
        tenant: str,
        cls: str = NO_CLASS,
        message: str | None = None,
        headers: Headers | None = None,
        param: str | None = None,
    ) -> None:
        self.metrics.refused(cls, tenant, reason)
        status, body = reason_error(reason, message, param)
        await send_bytes(send, status, body, JSON_HEADERS + headers if headers else JSON_HEADERS)

    async def complete(self, scope: Scope, receive: Receive, send: Send, route: Route) -> None:
        now = self.clock()
        sched = self.scheduler
        heads = read_headers(scope, self._session_key)
        key = heads.api_key
        got = await self._tenant_and_body(scope, receive, send, key)
        if got is None:
            return
        tenant, body = got
        try:
            b = parse_body(body, route, self.cfg.admission)
        except BadBody as exc:
            await self._refuse(send, exc.code, tenant, message=str(exc), param=exc.param)
            return
        if b.stream_options is not None and not b.stream:
            # the engine is asked for a stream whatever the client asked (its answer is then
            # assembled), so what vLLM and OpenAI refuse must be refused here
            await self._refuse(send, "invalid_body", tenant, param="stream_options",
                               message="Stream options can only be defined when `stream=True`.")
            return
        models = self.models()
        model = b.model if b.model is not None else (models[0] if models else "")
        if model not in models:
            if any(not e.ready and not e.models() for e in self.engines.values()):
                # an engine that has not answered yet may serve it: not a permanent 404
                await self._refuse(send, "model_unavailable", tenant,
                                   headers=retry_after_header(self.driver.probe_interval_s))
                return
            await self._refuse(
                send, "model_not_found", tenant,
                message=f"The model `{model}` does not exist. Served models: "
                + (", ".join(models) or "none") + ".",
            )
            return
        for eng in self.engines.values():
            problem = eng.check_body(body, route)
            if problem is not None:
                await self._refuse(
                    send, "invalid_body", tenant, message=problem.message, param=problem.param
                )
                return
        try:
            qos_class, priority = self._qos_hints(
                b.qos_class, b.priority if isinstance(b.priority, int) else None,
                heads.qos_class, heads.qos_priority)
        except ValueError:
            await self._refuse(send, "invalid_priority", tenant, param="x-qos-priority",
                               message="x-qos-priority must be an integer.")
            return
        session: str | None = None
        if heads.session is not None:
            session = session_id(heads.session)
            if session is None:
                await self._refuse(send, "invalid_session", tenant, param=self.session_header,
                                   message=session_message(self.session_header))
                return
        elif self.session_from_user:
            user = user_of(b)
            session = session_id(user) if user is not None else None
        # the output cap as the engine reads it: max_completion_tokens (OpenAI's newer name)
        # first; none stays none (the engine's own default: vLLM's is the rest of the context)
        asked = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
        prompt_tokens = estimate_prompt_tokens(b)
        # the prompt's keys: from its token ids where the replicas publish their KV events
        # (precise mode: as the engines' events name blocks), else from its text
        # (only for a router that reads them: hashing a long prompt is not free)
        prefix = None
        if sched.reads_prefix:
            if self.precise is not None:
                prefix = await self.precise.prefix_of(body, route, model)
            if prefix is None:
                prefix = body_prefix(b)
        rid = self._id_prefix + str(next(self._ids))
        try:
            req = sched.make_request(
                rid,
                QosInputs(
                    api_key=key,
                    qos_class=qos_class,
                    priority=priority,
                    task_type=b.task_type,
                    latency_budget_ms=b.latency_budget_ms,
                ),
                now,
                prompt_tokens,
                asked,
                model,
                context=self.context(model),
                prefix=prefix,
                session=session,
            )
        except QosInputError as exc:
            await self._refuse(send, exc.code, tenant, message=exc.message,
                               param=input_param(exc, heads.qos_class))
            return
        limits = self.cfg.admission
        most = limits.max_output_tokens
        if req.ceiling is not None and req.ceiling < most:
            most = req.ceiling
        for name, v in (("max_completion_tokens", b.max_completion_tokens),
                        ("max_tokens", b.max_tokens)):
            if v is not None and not 1 <= v <= most:
                whose = ("" if most == limits.max_output_tokens else
                         f" (the output ceiling of class {req.service_class} or its tenant)")
                await self._refuse(
                    send, "invalid_max_tokens", tenant, req.service_class, param=name,
                    message=f"{name} is {v}; it must be between 1 and {most}{whose}.",
                )
                return
        if prompt_tokens > limits.max_prompt_tokens:
            await self._refuse(
                send, "prompt_too_long", tenant, req.service_class,
                param="messages" if route == "chat" else "prompt",
                message=f"The prompt is about {prompt_tokens} tokens ({estimate_how(b)}"
                f"), over the limit of {limits.max_prompt_tokens} tokens.",
            )
            return
        inserted: Headers = []
        if asked is None and req.ceiling is not None:
            # a configured ceiling is the only cap the gateway adds, and the response says so;
            # into the member the client named (null), else max_tokens, never beside the other
            if b.has_max_completion_tokens:
                body = set_member(body, "max_completion_tokens", req.ceiling, True)
            else:
                body = set_member(body, "max_tokens", req.ceiling, b.has_max_tokens)
            asked = req.ceiling
            inserted = [(b"x-qosgate-inserted-max-tokens", str(req.ceiling).encode())]
        qos_headers = await self._qos_headers_unless_draining(send, tenant, req)
        if qos_headers is None:
            return
        engine_request = EngineRequest(
            rid=rid,
            route=route,
            body=body,
            stream=bool(b.stream),
            model=model,
            max_tokens=asked,
            prompt_tokens=prompt_tokens,
            include_usage=bool(b.stream_options and b.stream_options.include_usage),
            has_priority=b.priority is not msgspec.UNSET,
            first_byte_timeout_s=self._first_byte_s[req.class_level],
        )
        sink = AsgiSink(send, qos_headers + inserted if inserted else qos_headers)
        t = self.driver.ticket(req, engine_request, sink)
        self.driver.submit(t)
        if not t.finished.done():
            keepalive = (self._keepalive(t, sink)
                         if engine_request.stream and self.sse_keepalive_s else None)
            try:
                await self._await_end(receive, t)
            finally:
                if keepalive is not None:
                    keepalive[0].cancel()
        await self._conclude(t)

    async def _qos_headers_unless_draining(
        self, send: Send, tenant: str, req: Request
    ) -> Headers | None:
        """The response headers naming the request and its class; None once a draining gateway
        has refused it (503 with Retry-After)."""
        qos_headers: Headers = [
            (b"x-qosgate-request-id", req.id.encode()),
            (b"x-qosgate-class", req.service_class.encode()),
        ]
        if not self.driver.accepting:
            await self._refuse(send, "shutting_down", tenant, req.service_class,
                               headers=qos_headers + retry_after_header(None))
            return None
        return qos_headers

    def _qos_hints(
        self, qos_class: str | None, priority: int | None, class_header: bytes | None,
        priority_header: bytes | None,
    ) -> tuple[str | None, int | None]:
        """The class and priority a request asks for: the headers win over the body's members;
        class names are case-insensitive. Raises ValueError for a priority header that is not
        an integer."""
        if class_header is not None:
            qos_class = class_header.decode("latin-1").strip()
        if qos_class is not None:
            qos_class = self._class_names.get(qos_class.lower(), qos_class)
        if priority_header is not None:
            priority = int(priority_header)
        return qos_class, priority

    async def _tenant_and_body(
        self, scope: Scope, receive: Receive, send: Send, key: str | None
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
            await self._refuse(send, "body_too_large", tenant, message=(
                f"The request body is over the limit of {self.max_body} bytes."))
            return None
        except BodyTimeout:
            await self._refuse(send, "body_timeout", tenant, message=(
                "The request body did not arrive within "
                f"{self.body_timeout_s:g} s."),
                headers=[(b"connection", b"close")])
            return None
        except ClientGone:
            self.metrics.ended(NO_CLASS, tenant, "cancelled", "client_disconnected")
            return None
        if denied is not None:
            await self._refuse(send, denied.code, tenant,
                               message=denied_message(denied, scope))
            return None
        return tenant, body

    async def embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/embeddings``: classified, admitted and queued as a completion is; once
        dispatched, collected by its replica's batcher and served in a batch."""
        now = self.clock()
        sched = self.scheduler
        key = request_key(scope)
        got = await self._tenant_and_body(scope, receive, send, key)
        if got is None:
            return
        tenant, body = got
        es = self.embeddings_settings
        try:
            b = parse_embeddings(body, es.max_inputs, es.max_input_tokens)
        except BadEmbeddings as exc:
            await self._refuse(send, exc.code, tenant, message=str(exc), param=exc.param)
            return
        serving = {n: e for n, e in self.engines.items() if getattr(e, "embeds", False)}
        models: dict[str, None] = {}
        for e in serving.values():
            for m in e.models():
                models.setdefault(m, None)
        model = b.model if b.model is not None else next(iter(models), "")
        if model not in models:
            await self._refuse(
                send, "model_not_found", tenant, param="model",
                message=f"The model `{model}` does not serve embeddings here. Embedding models: "
                + (", ".join(models) or "none") + ".",
            )
            return
        class_header = header(scope, b"x-qos-class")
        try:
            qos_class, priority = self._qos_hints(
                b.qos_class, b.priority, class_header, header(scope, b"x-qos-priority"))
        except ValueError:
            await self._refuse(send, "invalid_priority", tenant, param="x-qos-priority",
                               message="x-qos-priority must be an integer.")
            return
        rid = self._id_prefix + str(next(self._ids))
        try:
            req = sched.make_request(
                rid,
                QosInputs(api_key=key, qos_class=qos_class, priority=priority,
                          task_type=b.task_type, latency_budget_ms=b.latency_budget_ms),
                now, b.tokens, 1, model,
            )
        except QosInputError as exc:
            await self._refuse(send, exc.code, tenant, message=exc.message,
                               param=input_param(exc, class_header))
            return
        if b.tokens > self.cfg.admission.max_prompt_tokens:
            await self._refuse(
                send, "prompt_too_long", tenant, req.service_class, param="input",
                message=f"The input is about {b.tokens} tokens (text estimated as characters "
                f"/ 4), over the limit of {self.cfg.admission.max_prompt_tokens} tokens.",
            )
            return
        qos_headers = await self._qos_headers_unless_draining(send, tenant, req)
        if qos_headers is None:
            return
        engine_request = EngineRequest(
            rid=rid, route="embeddings", body=body, stream=False, model=model, max_tokens=1,
            prompt_tokens=b.tokens, has_priority=b.has_priority,
            first_byte_timeout_s=self._first_byte_s[req.class_level], inputs=b.inputs,
            encoding_format=b.encoding_format, dimensions=b.dimensions, user=b.user,
        )
        sink = AsgiSink(send, qos_headers)
        t = self.driver.ticket(req, engine_request, sink)
        self.driver.submit(t)
        if not t.finished.done():
            await self._await_end(receive, t)
        await self._conclude(t)

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
