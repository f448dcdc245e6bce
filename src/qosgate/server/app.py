"""The gateway's ASGI app: what it is built of (the scheduler, the driver, shared state,
embeddings batching, metrics), its life (start-up, shutdown), and its routes: the OpenAI ones go to
``server/flow.py`` (one request's way from its body to its answer), the rest -- ``/v1/models``,
health and readiness, ``/metrics``, ``/v1/qos/status`` -- are answered here. Who is asking (keys,
QoS headers) is ``server/auth.py``.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import math
import time
from collections.abc import Awaitable
from typing import Any

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST

from qosgate.config import QosConfig
from qosgate.core import QosInputError, ReplicaSpec, Request, Scheduler
from qosgate.core.batching import Batcher, BatchLimits, make_controller
from qosgate.core.ledger import LeasedLedger
from qosgate.core.shared import prime
from qosgate.runtime.batches.directory import BatchDirectory, batch_directory
from qosgate.runtime.batches.feeder import Feeder
from qosgate.runtime.batches.lease import Lease, LocalLease, RedisLease
from qosgate.runtime.batches.store import BatchStore
from qosgate.runtime.batching import BatchingEngine
from qosgate.runtime.driver import Driver
from qosgate.runtime.ports import Engine
from qosgate.runtime.precise import PreciseCache
from qosgate.runtime.shared_state import (
    InstanceInfo,
    RedisStore,
    SharedState,
    new_instance_id,
    status_of,
)
from qosgate.runtime.upstream.replica import OpenAIUpstream
from qosgate.server.asgi import (
    Receive,
    Scope,
    Send,
    lifespan,
    not_allowed,
    send_bytes,
    send_json,
)
from qosgate.server.auth import denied_message, request_key
from qosgate.server.batches import BatchRoutes
from qosgate.server.batches_lines import FlowLines
from qosgate.server.errors import reason_error
from qosgate.server.flow import NO_CLASS, UNKNOWN_TENANT, RequestFlow
from qosgate.server.metrics import BatchingCollector, BatchJobsCollector, GatewayMetrics
from qosgate.server.status import jobs_view, status_view
from qosgate.settings import GatewaySettings
from qosgate.wire.errors import error_json
from qosgate.wire.responses import context_of, merge_cards, models_list

log = logging.getLogger("qosgate.gateway")


# the routes and their methods: another method on one of these paths is a 405, not a 404
_POST_PATHS = frozenset(("/v1/chat/completions", "/v1/completions", "/v1/embeddings"))
_GET_PATHS = frozenset(("/v1/models", "/healthz", "/health", "/readyz", "/v1/qos/status"))


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
        batch_dir: BatchDirectory | None = None,
    ) -> None:
        """``batch_dir``: where the Batch API keeps its jobs, already claimed by the caller
        (``server.run.build_gateway`` takes it before loading a model); default: this
        gateway's (``batch_directory``), claimed at start-up."""
        self.cfg = cfg
        self.settings = settings
        self.engines = engines
        self.clock = time.monotonic
        # shared tenant state (docs/guides/several-instances.md): leased budgets synced with Redis
        rs = settings.redis
        self.instance = rs.instance_id or new_instance_id()
        ledger = LeasedLedger() if rs.url else None
        # precise mode: the replicas whose index follows their engine's KV events
        upstreams = [(e.name, e.cfg, e) for e in engines.values() if isinstance(e, OpenAIUpstream)]
        with_events = {name for name, u, _ in upstreams if u.kv_events is not None}
        self.scheduler = Scheduler(
            cfg,
            policy,
            [
                # an in-process engine's window is its batch (it is scheduled here, token by
                # token); an upstream's adapts to what the engine reports of its own load
                ReplicaSpec(name, e.max_window, e.pausable, models=tuple(e.models()),
                            ordered=e.ordered, cache_events=name in with_events)
                for name, e in engines.items()
            ],
            ledger=ledger,
        )
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
        self.batching = [
            BatchingEngine(
                e,  # type: ignore[arg-type]
                Batcher(
                    BatchLimits(es.max_batch, es.max_batch_tokens, es.max_inflight_batches),
                    make_controller(es.window, linger_s=es.window_ms / 1000,
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
            on_cached=self.metrics.prompt_cache,
        )
        self.precise = PreciseCache.build(upstreams, self.scheduler, self.driver)
        self.flow = RequestFlow(cfg, settings, engines, self.scheduler, self.driver,
                                self.metrics, self.models, self._context, self.precise)
        self.admin_keys = frozenset(settings.server.admin_keys)
        self.open = self.scheduler.classifier.open
        self._contexts: dict[str, int | None] = {}
        self._contexts_until = -math.inf
        self.metrics.cap_tenants(settings.server.metrics_max_tenants)
        # the local port /metrics is served on when it has a listener of its own (server/run.py)
        self.metrics_port: int | None = None
        self.started = False
        bs = settings.batches  # the Batch API: its directory is taken, its store opened at start
        self.batch_dir = ((batch_dir or batch_directory(settings, self.instance))
                          if bs.enabled else None)
        self.batch_store = (BatchStore(self.batch_dir.path, time.time, bs.max_lines)
                            if self.batch_dir is not None else None)
        self.batch_routes = (BatchRoutes(cfg, settings, self.batch_store, self.scheduler,
                                         self.metrics) if self.batch_store is not None else None)
        # the feeder runs the jobs' lines through self.flow; the routes wake it
        self.feeder: Feeder | None = None
        if (self.batch_dir is not None and self.batch_dir.feeds and self.batch_store is not None
                and self.batch_routes is not None):
            lease: Lease = (RedisLease(rs.url, self.instance, bs.lease_ttl_s, rs.prefix)
                            if rs.url else LocalLease())
            self.feeder = Feeder(self.batch_store, FlowLines(self.flow, cfg), lease, bs,
                                 self._batch_capacity, lambda m: m in self.models(),
                                 lambda: len(self.scheduler.requests), time.time, self.clock)
            self.batch_routes.on_created = self.batch_routes.on_cancel = self.feeder.notify
            self.metrics.registry.register(BatchJobsCollector(self.feeder))

    def _room(self, replica: str) -> bool:
        """May ``replica`` still take another dispatch (its batcher's question)."""
        rep = self.scheduler.replicas.get(replica)
        return rep is not None and rep.free > 0

    def _batch_capacity(self) -> int:
        """Requests the fleet runs at once (the replicas' windows): a job keeps this many
        lines in flight, and its queue, so that it fills an idle fleet."""
        return sum(rep.window for rep in self.scheduler.replicas.values())

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
        if self.batch_dir is not None and self.batch_store is not None:
            self.batch_dir.claim()  # another deployment's directory stops start-up here
            for level, note in self.batch_dir.notes:
                log.log(level, note)
            await self.batch_store.open()
        await self.driver.start()
        if self.precise is not None:
            self.precise.start()
        if self.shared is not None:
            prime(self.shared.ledger, [(t.name, t.limits) for t in self.cfg.tenants],
                  self.clock())
            await self.shared.start()
        if self.feeder is not None:
            self.feeder.start()
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
        if self.feeder is not None:  # before the driver: running lines are disconnected
            await self.feeder.stop()
        if self.precise is not None:
            await self.precise.close()
        await self.driver.close()
        if self.shared is not None:
            await self.shared.close()
        if self.batch_store is not None:
            await self.batch_store.close()
        if self.batch_dir is not None:
            self.batch_dir.release()

    def begin_shutdown(self) -> None:
        """SIGTERM: stop admitting and reject everything queued with 503; running requests go on."""
        if self.feeder is not None:
            self.feeder.pause()
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
                    await self._guarded(self.flow.complete(scope, receive, send, "chat"), send)
                    return
                if path == "/v1/completions":
                    await self._guarded(
                        self.flow.complete(scope, receive, send, "completions"), send)
                    return
                if path == "/v1/embeddings":
                    await self._guarded(self.flow.embeddings(scope, receive, send), send)
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
                await not_allowed(send, method, path, b"POST")
                return
            if path in _GET_PATHS or (path == "/metrics" and self.metrics_port is None):
                await not_allowed(send, method, path, b"GET, HEAD")
                return
            if self.batch_routes is not None and await self.batch_routes.handle(
                    scope, receive, send):
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
            self.metrics.refused(NO_CLASS, UNKNOWN_TENANT, "internal_error")
            status, body = reason_error("internal_error")
            with contextlib.suppress(Exception):  # the response may have begun
                await send_bytes(send, status, body)

    async def _metrics(self, scope: Scope, send: Send) -> None:
        if self.settings.server.metrics_auth and request_key(scope) not in self.admin_keys:
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
            await not_allowed(send, method, path, b"GET, HEAD")
        else:
            await send_bytes(send, 404, error_json(
                f"No route {method} {path} on the metrics port.", "invalid_request_error",
                "not_found"))

    async def _models(self, scope: Scope, send: Send) -> None:
        if not self.open:
            try:
                self.scheduler.classifier.tenant_for(request_key(scope))
            except QosInputError as exc:
                await send_bytes(send, 401, error_json(denied_message(exc, scope),
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
        key = request_key(scope)
        tenant: str | None = None
        if not self.open and (key is None or key not in self.admin_keys):
            try:
                t = self.scheduler.classifier.tenant_for(key)
            except QosInputError as exc:
                await send_bytes(send, 401, error_json(denied_message(exc, scope),
                                                       "invalid_request_error", exc.code))
                return
            tenant = t.name if t is not None else None
        view = status_view(self.scheduler, self.clock(), tenant)
        view["accepting"] = self.driver.accepting
        view.update(status_of(self.shared, self.instance))
        if self.batch_store is not None:
            running = self.feeder.snapshot().in_flight if self.feeder is not None else {}
            view["batches"] = jobs_view(await self.batch_store.live(), running, tenant)
        await send_json(send, 200, view)

    # ------------------------------------------------------------------ completions
