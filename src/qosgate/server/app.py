"""The gateway's ASGI app: its parts (the scheduler, the driver, shared state, embeddings
batching, metrics, the Batch API; built by ``server/compose.py``), their life (start-up,
shutdown), and the routes: the OpenAI ones go to
``server/flow.py`` (one request's way from its body to its answer), the rest -- ``/v1/models``,
health and readiness, ``/metrics``, ``/v1/qos/status`` -- are answered here. Who is asking (keys,
QoS headers) is ``server/auth.py``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST

from qosgate.config import ConfigError, QosConfig
from qosgate.core import QosInputError, Scheduler
from qosgate.core.shared import prime
from qosgate.runtime.batches.directory import BatchDirectory
from qosgate.runtime.batches.feeder import Feeder
from qosgate.runtime.batches.store import BatchStore
from qosgate.runtime.batching import BatchingEngine
from qosgate.runtime.driver import Driver
from qosgate.runtime.ports import Engine
from qosgate.runtime.precise import PreciseCache
from qosgate.runtime.shared_state import SharedState, status_of
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
from qosgate.server.catalog import Catalog
from qosgate.server.errors import reason_error
from qosgate.server.flow import UNKNOWN_TENANT, RequestFlow
from qosgate.server.metrics import GatewayMetrics
from qosgate.server.passthrough import PassThrough
from qosgate.server.prepare import NO_CLASS
from qosgate.server.reload import Changes, ReloadRefused, applied, changes
from qosgate.server.routes import METHODS, PASSED, served
from qosgate.server.status import jobs_view, status_view
from qosgate.server.upstreams import Upstreams
from qosgate.settings import GatewaySettings
from qosgate.wire.answers import models_list
from qosgate.wire.errors import error_json
from qosgate.wire.sse import JSON_HEADERS

log = logging.getLogger("qosgate.gateway")


def _local_port(scope: Scope) -> int | None:
    server = scope.get("server")
    return int(server[1]) if server and server[1] is not None else None


@dataclass
class GatewayParts:
    """What a gateway is built of, wired together by ``server.compose.assemble``."""

    cfg: QosConfig
    settings: GatewaySettings
    engines: dict[str, Engine]  # replica name -> engine
    catalog: Catalog
    clock: Callable[[], float]
    instance: str  # this instance's id in /metrics and /v1/qos/status
    scheduler: Scheduler
    metrics: GatewayMetrics
    shared: SharedState | None  # tenant state shared through Redis
    batching: list[BatchingEngine]  # embeddings batching, one per replica that embeds
    driver: Driver
    precise: PreciseCache | None  # replicas whose index follows their engine's KV events
    flow: RequestFlow
    batch_dir: BatchDirectory | None  # the Batch API's: taken at start-up
    batch_store: BatchStore | None
    batch_routes: BatchRoutes | None
    feeder: Feeder | None  # runs the jobs' lines through the flow
    passthrough: PassThrough  # the utility routes, to a replica
    upstreams: Upstreams  # what a reload adds and retires


class Gateway:
    """The ASGI app: routes requests to its parts and runs their life. Built by
    ``server.compose.build_gateway``."""

    def __init__(self, parts: GatewayParts) -> None:
        self.cfg = parts.cfg
        self.settings = parts.settings
        self.engines = parts.engines
        self.catalog = parts.catalog
        self.clock = parts.clock
        self.instance = parts.instance
        self.scheduler = parts.scheduler
        self.metrics = parts.metrics
        self.shared = parts.shared
        self.batching = parts.batching
        self.driver = parts.driver
        self.precise = parts.precise
        self.flow = parts.flow
        self.batch_dir = parts.batch_dir
        self.batch_store = parts.batch_store
        self.batch_routes = parts.batch_routes
        self.feeder = parts.feeder
        self.passthrough = parts.passthrough
        self.upstreams = parts.upstreams
        self.admin_keys = frozenset(parts.settings.server.admin_keys)
        # where a reload reads the config again (``cli.py`` sets it: the file and the flags
        # start-up read); None: started without one, nothing to reload
        self.config_source: Callable[[], tuple[QosConfig, GatewaySettings]] | None = None
        self.generation = 1  # the config in force: 1 at start, one more per reload applied
        self.reloads = self.metrics.counters.reloads  # qosgate_config_reloads_total
        # the local port /metrics is served on when it has a listener of its own (server/run.py)
        self.metrics_port: int | None = None
        self.started = False
        self.leaving = False  # SIGTERM came: /readyz answers 503, before and during the drain

    @property
    def open(self) -> bool:
        """No tenants configured: every key serves, as the default tenant."""
        return self.scheduler.classifier.open

    # ------------------------------------------------------------------ reload
    def reload(self) -> Changes:
        """Read the config again and apply what a running gateway can take (``server/reload.py``)
        in one step; ``ReloadRefused`` (logged, counted) leaves the running config as it is.
        Runs on the event loop: nothing is half-applied to a request being admitted."""
        try:
            if self.config_source is None:
                raise ReloadRefused("the gateway was started without a config file")
            try:
                cfg, settings = self.config_source()
            except ConfigError as exc:
                raise ReloadRefused(str(exc)) from None
            found = changes((self.scheduler.cfg, self.settings), (cfg, settings))
        except ReloadRefused as exc:
            self.reloads["refused"] += 1
            log.error("config reload refused, the running config is kept: %s", exc)
            raise
        self.scheduler.retenant(cfg, self.clock())
        self.cfg = self.scheduler.cfg
        self.admin_keys = frozenset(settings.server.admin_keys)
        self.upstreams.apply(found, settings.upstreams)
        self.settings = applied(self.settings, settings, found)
        self.metrics.cap_tenants(self.settings.server.metrics_max_tenants)
        self.generation += 1
        self.reloads["applied"] += 1
        log.warning("config reloaded (generation %d): %s", self.generation, found.describe())
        return found

    def reload_now(self) -> None:
        """``reload`` from a signal (SIGHUP): its refusal is logged there, nothing to answer."""
        with contextlib.suppress(ReloadRefused):
            self.reload()

    # ------------------------------------------------------------------ life
    def models(self) -> list[str]:
        return self.catalog.models()

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
        self.flow.request_log.close()

    def begin_shutdown(self) -> None:
        """SIGTERM: stop admitting; answer 503 at once to every request whose answer has not
        begun (queued, or at an upstream engine that sent nothing back); running ones go on."""
        self.leaving = True
        if self.feeder is not None:
            self.feeder.pause()
        queued, waiting = self.driver.drain("shutting_down")
        log.warning("draining: %d queued and %d not yet started request(s) refused with 503, "
                    "%d running may finish within %g s", queued, waiting,
                    len(self.driver.tickets), self.settings.server.shutdown_timeout_s)

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
                    await self._guarded(self.flow.complete(scope, receive, send, "chat"), scope,
                                        send)
                    return
                if path == "/v1/completions":
                    await self._guarded(
                        self.flow.complete(scope, receive, send, "completions"), scope, send)
                    return
                if path == "/v1/responses":
                    await self._guarded(
                        self.flow.complete(scope, receive, send, "responses"), scope, send)
                    return
                if path == "/v1/embeddings":
                    await self._guarded(self.flow.embeddings(scope, receive, send), scope, send)
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
            if method == "POST" and path == "/v1/qos/reload":
                await self._reload(scope, send)
                return
            allowed = METHODS.get(path)
            if path in PASSED and allowed is not None and method in allowed:
                await self._guarded(self.passthrough.handle(scope, receive, send, path, method),
                                    scope, send)
                return
            if allowed is not None and (path != "/metrics" or self.metrics_port is None):
                await not_allowed(send, method, path, ", ".join(allowed).encode())
                return
            if self.batch_routes is not None and await self.batch_routes.handle(
                    scope, receive, send):
                return
            await send_bytes(send, 404, error_json(
                f"No route {method} {path}. Routes served: "
                f"{served(self.batch_routes is not None)}.", "invalid_request_error",
                "not_found"))
        elif kind == "lifespan":
            await lifespan(receive, send, self.startup, self.shutdown)

    async def _guarded(self, work: Awaitable[None], scope: Scope, send: Send) -> None:
        """A bug must not reach the client as uvicorn's plain-text 500: answer in OpenAI's
        format (if nothing was sent yet), count the request and log it."""
        try:
            await work
        except Exception:
            log.exception("a request failed in the gateway")
            self.metrics.refused(NO_CLASS, UNKNOWN_TENANT, "internal_error")
            named = self.flow.internal_error(scope)
            status, body = reason_error("internal_error")
            with contextlib.suppress(Exception):  # the response may have begun
                await send_bytes(send, status, body, JSON_HEADERS + named)

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
        await send_json(send, 200, models_list(self.catalog.model_cards()))

    async def _reload(self, scope: Scope, send: Send) -> None:
        """``POST /v1/qos/reload``: an admin key reloads the config file; the answer says what
        changed, or why nothing did (400, the running config kept)."""
        if request_key(scope) not in self.admin_keys:
            await send_bytes(send, 401 if self.admin_keys else 403, error_json(
                "Reloading the config needs an admin key (server.admin_keys)."
                if self.admin_keys else "No admin key is configured (server.admin_keys): "
                "reload with SIGHUP.", "invalid_request_error", "invalid_api_key"))
            return
        try:
            found = self.reload()
        except ReloadRefused as exc:
            await send_bytes(send, 400, error_json(
                f"The config was not reloaded: {exc}", "invalid_request_error",
                "config_refused"))
            return
        await send_json(send, 200, {"generation": self.generation, **found.summary()})

    async def _ready(self, send: Send) -> None:
        up = any(e.ready for e in self.engines.values())
        if self.started and not self.leaving and up:
            await send_json(send, 200, {"status": "ready"})
        else:
            why = "draining" if self.leaving else "no engine is ready"
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
        view["config"] = {"generation": self.generation, "reloads": dict(self.reloads)}
        view.update(status_of(self.shared, self.instance))
        if self.batch_store is not None:
            running = self.feeder.snapshot().in_flight if self.feeder is not None else {}
            view["batches"] = jobs_view(await self.batch_store.live(), running, tenant)
        await send_json(send, 200, view)

    # ------------------------------------------------------------------ completions
