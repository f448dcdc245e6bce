"""The gateway's ASGI app: OpenAI routes, SSE, auth, errors, /metrics and /v1/qos/status.

A request's way: key -> tenant (401), body read with the fast partial parser (400), model (404),
QoS inputs from the body (``priority``, ``latency_budget_ms``, ``task_type``, ``qos_class``) or
the ``x-qos-class`` / ``x-qos-priority`` headers, then the scheduler (413/429/503/504 refusals).
While it waits, its task watches the client and cancels the request if the client goes away
(queued: removed; running: aborted at the engine). Success bytes are written by the engine call
itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import itertools
import logging
import math
import os
import time
from collections.abc import Awaitable
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST

from qosgate.config import QosConfig
from qosgate.core import QosInputError, QosInputs, ReplicaSpec, Request, Scheduler, State
from qosgate.core.batching import Batcher, BatchLimits, make_controller
from qosgate.core.ledger import LeasedLedger
from qosgate.core.shared import prime
from qosgate.runtime.batching import BatchingEngine
from qosgate.runtime.driver import Driver, Ticket
from qosgate.runtime.ports import Engine
from qosgate.runtime.shared_state import (
    InstanceInfo,
    RedisStore,
    SharedState,
    new_instance_id,
    status_of,
)
from qosgate.server.asgi import (
    AsgiSink,
    BodyTimeout,
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    header,
    lifespan,
    read_body,
    send_bytes,
    send_json,
    wait_disconnect,
)
from qosgate.server.errors import outcome_error, reason_error, retry_after_header
from qosgate.server.metrics import BatchingCollector, GatewayMetrics
from qosgate.server.status import status_view
from qosgate.settings import GatewaySettings
from qosgate.wire.embeddings import BadEmbeddings, parse_embeddings
from qosgate.wire.errors import error_json
from qosgate.wire.job import Job, Route
from qosgate.wire.parse import BadBody, estimate_how, estimate_prompt_tokens, parse_body
from qosgate.wire.responses import context_of, merge_cards, models_list
from qosgate.wire.splice import set_member
from qosgate.wire.sse import JSON_HEADERS, Headers, error_end

log = logging.getLogger("qosgate.gateway")

_NO_CLASS = "none"
_UNKNOWN_TENANT = "unknown"


def _key_of(auth: bytes | None) -> str | None:
    """The API key of an ``Authorization: Bearer`` header value."""
    if auth is None:
        return None
    if auth[:7].lower() == b"bearer ":
        return auth[7:].strip().decode("latin-1") or None
    return None


def _bearer(scope: Scope) -> str | None:
    """The request's API key: ``Authorization: Bearer KEY``, else ``x-api-key: KEY``."""
    key = _key_of(header(scope, b"authorization"))
    if key is None:
        key = _plain_key(header(scope, b"x-api-key"))
    return key


def _plain_key(value: bytes | None) -> str | None:
    """The API key of an ``x-api-key`` header value."""
    if value is None:
        return None
    return value.strip().decode("latin-1") or None


def _denied_message(exc: QosInputError, scope: Scope) -> str:
    """A refused key's message; an ``Authorization`` header sent without the ``Bearer`` scheme
    (or with no key after it) says so, rather than that no key was sent."""
    if exc.code == "invalid_api_key" and _bearer(scope) is None:
        auth = header(scope, b"authorization")
        if auth is not None and auth.strip():
            return ("The Authorization header must be 'Bearer <key>' (the API key after the "
                    "word Bearer and a space).")
    return exc.message


def _input_param(exc: QosInputError, class_header: bytes | None) -> str | None:
    """The ``param`` of a refused QoS input: the header when the class came from it."""
    if exc.param == "qos_class" and class_header is not None:
        return "x-qos-class"
    return exc.param


# the routes and their methods: another method on one of these paths is a 405, not a 404
_POST_PATHS = frozenset(("/v1/chat/completions", "/v1/completions", "/v1/embeddings"))
_GET_PATHS = frozenset(("/v1/models", "/healthz", "/health", "/readyz", "/v1/qos/status"))


async def _not_allowed(send: Send, method: str, path: str, allow: bytes) -> None:
    await send_bytes(
        send, 405,
        error_json(f"Method {method} is not allowed on {path}; use {allow.decode()}.",
                   "invalid_request_error", "method_not_allowed"),
        [(b"content-type", b"application/json"), (b"allow", allow)],
    )


def _local_port(scope: Scope) -> int | None:
    server = scope.get("server")
    return int(server[1]) if server and server[1] is not None else None


class Gateway:
    """The ASGI app. ``engines`` maps replica names to engines (see ``server.engines``)."""

    def __init__(
        self,
        cfg: QosConfig,
        settings: GatewaySettings,
        engines: dict[str, Engine],
        policy: str | None = None,
    ) -> None:
        self.cfg = cfg
        self.settings = settings
        self.engines = engines
        self.clock = time.monotonic
        # shared tenant state (docs/shared-state.md): leased budgets synced with Redis
        rs = settings.redis
        self.instance = rs.instance_id or new_instance_id()
        ledger = LeasedLedger() if rs.url else None
        self.scheduler = Scheduler(
            cfg,
            policy,
            [
                # an in-process engine's window is its batch (it is scheduled here, token by
                # token); an upstream's adapts to what the engine reports of its own load
                ReplicaSpec(name, e.capacity, e.pausable, models=tuple(e.models()),
                            ordered=e.ordered)
                for name, e in engines.items()
            ],
            ledger=ledger,
        )
        self._first_byte_s = [c.first_byte_timeout for c in cfg.classes]
        self.metrics = GatewayMetrics(self.scheduler, self.clock)
        self.shared: SharedState | None = None
        if rs.url and ledger is not None:
            sched = self.scheduler
            self.shared = SharedState(
                RedisStore(rs.url, rs.prefix, rs.timeout_s), ledger, self.clock,
                sched.policy.root, self.instance, rs.sync_interval_s, rs.lease_ttl_s,
                rs.fail_open, rs.degrade_after_s,
                info=lambda: msgspec.json.encode({
                    "queued_total": sched.queued_total,
                    "inflight": len(sched.requests) - sched.queued_total,
                }).decode(),
            )
            self.metrics.registry.register(self.shared)
        self.metrics.registry.register(InstanceInfo(self.instance, "redis" if rs.url else "none"))
        # embeddings: the calls of a replica whose engine serves batches are batched by a
        # decorator over it (runtime/batching.py), its window per core/batching.py
        es = settings.embeddings
        self.embed_settings = es
        self.batching = [
            BatchingEngine(
                e,  # type: ignore[arg-type]
                Batcher(
                    BatchLimits(es.max_batch, es.max_batch_tokens, es.max_inflight_batches),
                    make_controller(es.window, window_s=es.window_ms / 1000,
                                    floor_s=es.floor_ms / 1000, ceiling_s=es.ceiling_ms / 1000,
                                    target_s=es.target_ms / 1000, every=es.every,
                                    alpha=es.alpha),
                ),
                functools.partial(self._room, name), self.clock, es.urgent_levels,
            )
            for name, e in engines.items() if getattr(e, "embeds", False)
        ]
        self.metrics.registry.register(BatchingCollector(self.batching))
        batched = {b.name: b for b in self.batching}
        self.driver = Driver(
            self.scheduler, {name: batched.get(name, e) for name, e in engines.items()},
            clock=self.clock, on_finished=self._on_finished,
        )
        self.admin_keys = frozenset(settings.server.admin_keys)
        self.open = self.scheduler.classifier.open
        self.max_body = settings.server.max_body_bytes
        self._contexts: dict[str, int | None] = {}
        self._contexts_until = -math.inf
        self.metrics.cap_tenants(settings.server.metrics_max_tenants)
        # class names as clients may write them (x-qos-class: Realtime)
        self._class_names = {c.name.lower(): c.name for c in cfg.classes}
        self.sse_keepalive_s = settings.server.sse_keepalive_s
        # the local port /metrics is served on when it has a listener of its own (server/run.py)
        self.metrics_port: int | None = None
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(4).hex() + "-"
        self.started = False

    def _room(self, replica: str) -> bool:
        """May ``replica`` still take another dispatch (its batcher's question)."""
        rep = self.scheduler.replicas.get(replica)
        return rep is not None and rep.free > 0

    def _on_finished(self, req: Request) -> None:
        """A request ended (driver hook): the metrics, and a slot freed (a batch waiting for
        room may be due)."""
        self.metrics.observe(req)
        for b in self.batching:
            b.room_changed()

    # ------------------------------------------------------------------ life
    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for e in self.engines.values():
            for m in e.models():
                seen.setdefault(m, None)
        return list(seen)

    def model_cards(self) -> list[dict[str, Any]]:
        """``/v1/models``: the engines' own entries, each model once (``merge_cards``)."""
        return merge_cards([e.model_cards() for e in self.engines.values()])

    def _context(self, model: str) -> int | None:
        """The context length of ``model`` as its engines report it (the smallest), cached for
        a second: the engines' entries change only when a probe reads them again."""
        now = self.clock()
        if now >= self._contexts_until:
            self._contexts = {c["id"]: context_of(c) for c in self.model_cards()}
            self._contexts_until = now + 1.0
        return self._contexts.get(model)

    def replicas_up(self) -> dict[str, bool]:
        return {name: e.ready for name, e in self.engines.items()}

    async def startup(self) -> None:
        await self.driver.start()
        if self.shared is not None:
            prime(self.shared.ledger, [(t.name, t.limits) for t in self.cfg.tenants],
                  self.clock())
            await self.shared.start()
        self.started = True
        # Everything loaded so far lives as long as the process: move it out of the cyclic
        # collector's reach, so that its collections only walk what requests allocate (they
        # took ~7% of the gateway's CPU walking the imported modules' objects again and again).
        gc.collect()
        gc.freeze()
        if self.open:
            log.warning(
                "no tenants configured: the gateway runs OPEN, every request is tenant %r",
                self.cfg.default_tenant,
            )
        log.info("replicas: %s; models: %s", ", ".join(self.engines), ", ".join(self.models()))
        srv = self.settings.server
        if self.cfg.tenants and not srv.metrics_auth and srv.metrics_port is None:
            log.warning("/metrics shows every tenant's traffic to anyone who can reach port %d: "
                        "set server.metrics_auth (admin key) or server.metrics_port", srv.port)

    async def shutdown(self) -> None:
        await self.driver.close()
        if self.shared is not None:
            await self.shared.close()

    def begin_shutdown(self) -> None:
        """SIGTERM: stop admitting and reject everything queued with 503; running requests go on."""
        n = self.driver.drain("shutting_down")
        log.warning("shutting down: %d queued request(s) rejected, %d running",
                    n, len(self.driver.tickets))

    # ------------------------------------------------------------------ routing
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "http":
            path: str = scope["path"]
            method: str = scope["method"]
            if self.metrics_port is not None and _local_port(scope) == self.metrics_port:
                await self._metrics_listener(scope, send, method, path)
                return
            if method == "POST":
                if path == "/v1/chat/completions":
                    await self._guarded(self.complete(scope, receive, send, "chat"), send)
                    return
                if path == "/v1/completions":
                    await self._guarded(self.complete(scope, receive, send, "completions"), send)
                    return
                if path == "/v1/embeddings":
                    await self._guarded(self.embeddings(scope, receive, send), send)
                    return
            elif method in ("GET", "HEAD"):
                if path == "/v1/models":
                    await self._models(scope, send)
                    return
                if path in ("/healthz", "/health"):  # /health: vLLM's path
                    await send_json(send, 200, {"status": "ok"})
                    return
                if path == "/readyz":
                    await self._ready(send)
                    return
                if path == "/metrics" and self.metrics_port is None:
                    await self._metrics(scope, send)
                    return
                if path == "/v1/qos/status":
                    await self._status(scope, send)
                    return
            if path in _POST_PATHS:
                await _not_allowed(send, method, path, b"POST")
                return
            if path in _GET_PATHS or (path == "/metrics" and self.metrics_port is None):
                await _not_allowed(send, method, path, b"GET, HEAD")
                return
            await send_bytes(
                send, 404, error_json(f"No route {method} {path}.", "invalid_request_error",
                                      "not_found")
            )
        elif kind == "lifespan":
            await lifespan(receive, send, self.startup, self.shutdown)

    async def _guarded(self, work: Awaitable[None], send: Send) -> None:
        """A bug must not reach the client as uvicorn's plain-text 500: answer in OpenAI's
        format (if nothing was sent yet) and count the request."""
        try:
            await work
        except Exception:
            log.exception("a request failed in the gateway")
            self.metrics.refused(_NO_CLASS, _UNKNOWN_TENANT, "internal_error")
            status, body = reason_error("internal_error")
            with contextlib.suppress(Exception):  # the response may have begun
                await send_bytes(send, status, body)

    async def _metrics(self, scope: Scope, send: Send) -> None:
        if self.settings.server.metrics_auth and _bearer(scope) not in self.admin_keys:
            await send_bytes(send, 401, error_json(
                "/metrics needs an admin key (server.admin_keys).", "invalid_request_error",
                "invalid_api_key"))
            return
        await send_bytes(send, 200, self.metrics.render(),
                         [(b"content-type", CONTENT_TYPE_LATEST.encode())])

    async def _metrics_listener(self, scope: Scope, send: Send, method: str, path: str) -> None:
        """The metrics port (``server.metrics_port``): /metrics and the health checks only."""
        if method in ("GET", "HEAD") and path == "/metrics":
            await self._metrics(scope, send)
        elif method in ("GET", "HEAD") and path in ("/healthz", "/health"):
            await send_json(send, 200, {"status": "ok"})
        elif path in ("/metrics", "/healthz", "/health"):
            await _not_allowed(send, method, path, b"GET, HEAD")
        else:
            await send_bytes(send, 404, error_json(
                f"No route {method} {path} on the metrics port.", "invalid_request_error",
                "not_found"))

    async def _models(self, scope: Scope, send: Send) -> None:
        if not self.open:
            try:
                self.scheduler.classifier.tenant_for(_bearer(scope))
            except QosInputError as exc:
                await send_bytes(send, 401, error_json(_denied_message(exc, scope),
                                                       "invalid_request_error", exc.code))
                return
        await send_json(send, 200, models_list(self.model_cards()))

    async def _ready(self, send: Send) -> None:
        up = any(e.ready for e in self.engines.values())
        if self.started and self.driver.accepting and up:
            await send_json(send, 200, {"status": "ready"})
        else:
            why = "shutting down" if not self.driver.accepting else "no engine is ready"
            await send_json(send, 503, {"status": why})

    async def _status(self, scope: Scope, send: Send) -> None:
        key = _bearer(scope)
        tenant: str | None = None
        if not self.open and (key is None or key not in self.admin_keys):
            try:
                t = self.scheduler.classifier.tenant_for(key)
            except QosInputError as exc:
                await send_bytes(send, 401, error_json(_denied_message(exc, scope),
                                                       "invalid_request_error", exc.code))
                return
            tenant = t.name if t is not None else None
        view = status_view(self.scheduler, self.clock(), tenant)
        view["accepting"] = self.driver.accepting
        view.update(status_of(self.shared, self.instance))
        await send_json(send, 200, view)

    # ------------------------------------------------------------------ completions
    async def _refuse(
        self,
        send: Send,
        reason: str,
        tenant: str,
        cls: str = _NO_CLASS,
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
        # the request headers the gateway reads, in one pass (the first of each counts)
        auth = hc = hp = xkey = None
        for k, v in scope["headers"]:
            if k == b"authorization":
                if auth is None:
                    auth = v
            elif k == b"x-qos-class":
                if hc is None:
                    hc = v
            elif k == b"x-qos-priority":
                if hp is None:
                    hp = v
            elif k == b"x-api-key" and xkey is None:
                xkey = v
        key = _key_of(auth)
        if key is None:
            key = _plain_key(xkey)
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
                b.qos_class, b.priority if isinstance(b.priority, int) else None, hc, hp)
        except ValueError:
            await self._refuse(send, "invalid_priority", tenant, param="x-qos-priority",
                               message="x-qos-priority must be an integer.")
            return
        # the output cap as the engine reads it: max_completion_tokens (OpenAI's newer name)
        # first; none stays none (the engine's own default: vLLM's is the rest of the context)
        asked = b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens
        prompt_tokens = estimate_prompt_tokens(b)
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
                context=self._context(model),
            )
        except QosInputError as exc:
            await self._refuse(send, exc.code, tenant, message=exc.message,
                               param=_input_param(exc, hc))
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
        job = Job(
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
        t = self.driver.ticket(req, job, sink)
        self.driver.submit(t)
        if not t.finished.done():
            keepalive = self._keepalive(t, sink) if job.stream and self.sse_keepalive_s else None
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
        self, qos_class: str | None, priority: int | None, hc: bytes | None, hp: bytes | None
    ) -> tuple[str | None, int | None]:
        """The class and priority a request asks for: the headers win over the body's members;
        class names are case-insensitive. Raises ValueError for a priority header that is not
        an integer."""
        if hc is not None:
            qos_class = hc.decode("latin-1").strip()
        if qos_class is not None:
            qos_class = self._class_names.get(qos_class.lower(), qos_class)
        if hp is not None:
            priority = int(hp)
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
        tenant = (_UNKNOWN_TENANT if denied is not None else
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
                f"{self.settings.server.body_timeout_s:g} s."),
                headers=[(b"connection", b"close")])
            return None
        except ClientGone:
            self.metrics.ended(_NO_CLASS, tenant, "cancelled", "client_disconnected")
            return None
        if denied is not None:
            await self._refuse(send, denied.code, tenant,
                               message=_denied_message(denied, scope))
            return None
        return tenant, body

    async def embeddings(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/embeddings``: classified, admitted and queued as a completion is; once
        dispatched, collected by its replica's batcher and served in a batch."""
        now = self.clock()
        sched = self.scheduler
        key = _bearer(scope)
        got = await self._tenant_and_body(scope, receive, send, key)
        if got is None:
            return
        tenant, body = got
        es = self.embed_settings
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
        hc = header(scope, b"x-qos-class")
        try:
            qos_class, priority = self._qos_hints(
                b.qos_class, b.priority, hc, header(scope, b"x-qos-priority"))
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
                               param=_input_param(exc, hc))
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
        job = Job(
            rid=rid, route="embeddings", body=body, stream=False, model=model, max_tokens=1,
            prompt_tokens=b.tokens, has_priority=b.has_priority,
            first_byte_timeout_s=self._first_byte_s[req.class_level], inputs=b.inputs,
            encoding_format=b.encoding_format, dimensions=b.dimensions, user=b.user,
        )
        sink = AsgiSink(send, qos_headers)
        t = self.driver.ticket(req, job, sink)
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
            if t.job.stream:
                status, body, _ = outcome_error(req, self.cfg)
                await sink.send(error_end(body), False)
            else:
                await sink.send(b"", False)
            return
        if t.answer is not None and req.state is State.REJECTED:  # the engine's own 4xx
            status, body = t.answer
            await sink.whole(status, body, [(b"content-type", b"application/json")])
            return
        status, body, extra = outcome_error(req, self.cfg)
        await sink.whole(status, body, [(b"content-type", b"application/json"), *extra])

