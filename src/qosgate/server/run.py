"""Build the gateway from config and serve it with uvicorn (uvloop + httptools).

Start-up order: the listening sockets are bound first (a port in use stops start-up before a
model is loaded), then the engines are built, then uvicorn serves on those sockets, and only once
it does is "serving on" printed (``on_serving``).

Connections go through ``server/protocol.py`` (a connection cap, header and body timeouts, a
header size cap, OpenAI-format answers to malformed HTTP). The cap defaults to the process's
descriptor limit (raised to its hard limit at start-up) less a reserve for the engines'
connections and the process's own files.

Graceful shutdown on SIGTERM (or Ctrl+C): stop accepting connections, reject every queued request
with 503 + Retry-After at once, let running requests finish for up to ``shutdown_timeout_s``; then
the ones still running are cut -- a stream ends with an OpenAI error event (``server_shutdown``)
and ``[DONE]``, each counted once -- the engines close and the process exits 0. A second signal
forces the exit.
"""

from __future__ import annotations

import asyncio
import logging
import math
import resource
import socket
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from qosgate.config import QosConfig
from qosgate.models.simmodel import SimEngine, load_profile
from qosgate.runtime.batches.directory import batch_directory
from qosgate.runtime.embedded import llamacpp_from_settings
from qosgate.runtime.inprocess import InProcessEngine
from qosgate.runtime.ports import Engine
from qosgate.runtime.shared_state import new_instance_id
from qosgate.runtime.upstream.replica import OpenAIUpstream
from qosgate.server.app import Gateway
from qosgate.server.protocol import ConnectionLimits, ConnectionStats, guarded_protocol
from qosgate.settings import GatewaySettings, ServerSettings

log = logging.getLogger("qosgate.gateway")

DEFAULT_SIM_WINDOW = 64
BACKLOG = 4096
# descriptors kept back from the connection cap: the process's own files, the model, the event
# loop, the log -- and, for upstreams, one connection per request in each replica's window
FD_RESERVE = 64
# uvicorn's own cut, after ours: only if ours could not end a request (it should not happen)
_BACKSTOP_S = 5.0


def build_engines(settings: GatewaySettings) -> dict[str, Engine]:
    engines: dict[str, Engine] = {}
    if settings.upstreams:
        for i, u in enumerate(settings.upstreams):
            up = OpenAIUpstream(u, i)
            if up.name in engines:
                raise ValueError(f"two upstreams are named {up.name!r}")
            engines[up.name] = up
        return engines
    es = settings.engine
    if es.kind == "llamacpp":
        llama = llamacpp_from_settings(es)
        return {llama.name: llama}
    prof = load_profile(es.profile)
    if es.max_num_seqs is not None:
        prof = prof.model_copy(update={"max_num_seqs": es.max_num_seqs})
    # the engine orders by the band too (vLLM polarity) when its KV cache is contended
    sim = SimEngine(prof, "priority")
    engines["sim-0"] = InProcessEngine(
        sim,
        name="sim-0",
        max_window=es.capacity or min(prof.max_num_seqs, DEFAULT_SIM_WINDOW),
        models=[es.served_model_name or "qosgate-sim"],
        modelled_time=True,
        time_scale=es.time_scale,
        pausable=es.pausable,
        eos_after=es.eos_after,
    )
    return engines


def build_gateway(cfg: QosConfig, settings: GatewaySettings, policy: str | None = None,
                  worker: tuple[str, int] | None = None) -> Gateway:
    """The gateway, its batch directory taken first: a directory another deployment holds
    (``DirectoryRefused``) stops start-up before a model is loaded. ``worker``: (group, index)
    of a process of ``serve --workers``."""
    batch_dir = None
    if settings.batches.enabled:
        batch_dir = batch_directory(settings, settings.redis.instance_id or new_instance_id(),
                                    worker)
        batch_dir.claim()
    try:
        return Gateway(cfg, settings, build_engines(settings), policy, batch_dir)
    except BaseException:
        if batch_dir is not None:
            batch_dir.release()
        raise


# ---------------------------------------------------------------------- sockets
def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening: connections are refused until
    the server serves). ``OSError`` if the address cannot be bound."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, type_, proto, _, addr = infos[0]
    sock = socket.socket(family, type_, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:  # --workers N: the kernel spreads connections over the processes
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


class Listeners:
    """The bound sockets: the API port and, if configured, the metrics port."""

    def __init__(self, srv: ServerSettings) -> None:
        self.api = bind_socket(srv.host, srv.port, srv.reuse_port)
        self.metrics: socket.socket | None = None
        if srv.metrics_port is not None:
            try:
                self.metrics = bind_socket(srv.metrics_host or srv.host, srv.metrics_port)
            except OSError:
                self.api.close()
                raise

    @property
    def sockets(self) -> list[socket.socket]:
        return [self.api] if self.metrics is None else [self.api, self.metrics]

    @staticmethod
    def address(sock: socket.socket) -> str:
        host, port = sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def close(self) -> None:
        for s in self.sockets:
            s.close()


def connection_limits(settings: GatewaySettings) -> ConnectionLimits:
    """The connection guards; the cap, unless configured, from the descriptor limit."""
    srv = settings.server
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):  # pragma: no cover - not allowed here: keep the soft one
            pass
    reserve = FD_RESERVE + sum(u.capacity for u in settings.upstreams)
    fit = max(16, soft - reserve) if soft != resource.RLIM_INFINITY else 65_536
    cap = srv.max_connections if srv.max_connections is not None else fit
    if cap > fit:
        log.warning("server.max_connections %d is over what %d descriptors allow (%d); "
                    "connections past that fail at accept", cap, soft, fit)
    return ConnectionLimits(
        max_connections=cap,
        header_timeout_s=srv.header_timeout_s,
        body_timeout_s=srv.body_timeout_s,
        max_header_bytes=srv.max_header_bytes,
    )


# ---------------------------------------------------------------------- the server
class _Server(uvicorn.Server):
    """uvicorn, with the gateway's drain on the first signal, its cut of running requests at the
    shutdown timeout, "serving on" once it serves, and a clean exit code."""

    def __init__(
        self,
        config: uvicorn.Config,
        gateway: Gateway,
        on_serving: Callable[[], None] | None,
    ) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.on_serving = on_serving
        self.loop: asyncio.AbstractEventLoop | None = None
        self._cut: asyncio.TimerHandle | None = None

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit and self.on_serving is not None:
            self.on_serving()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not recorded in _captured_signals: uvicorn would re-raise it after serving, and the
        # process would die of the signal instead of exiting 0
        if self.should_exit:
            self.force_exit = True
            return
        self.should_exit = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._begin_shutdown)

    def _begin_shutdown(self) -> None:
        self.gateway.begin_shutdown()
        assert self.loop is not None
        self._cut = self.loop.call_later(
            self.gateway.settings.server.shutdown_timeout_s, self.cut_running
        )

    def cut_running(self) -> None:
        """The shutdown timeout ran out: end every request still running (its client gets an
        OpenAI error; a stream, an error event and ``[DONE]``)."""
        driver = self.gateway.driver
        tickets = list(driver.tickets.values())
        if tickets:
            log.warning("shutdown timeout: cutting %d running request(s)", len(tickets))
        for t in tickets:
            driver.cancel(t, "server_shutdown")


def serve(
    gateway: Gateway,
    listeners: Listeners,
    on_serving: Callable[[], None] | None = None,
) -> bool:
    """Serve on ``listeners`` until a signal; True if the server started (and so shut down
    cleanly). ``on_serving`` runs once the sockets accept connections."""
    srv = gateway.settings.server
    logging.basicConfig(
        level=srv.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # pragma: no cover
        loop = "asyncio"
    stats = ConnectionStats()
    gateway.metrics.registry.register(stats)
    if listeners.metrics is not None:
        gateway.metrics_port = int(listeners.metrics.getsockname()[1])
    config = uvicorn.Config(
        gateway,
        loop=loop,
        http=guarded_protocol(connection_limits(gateway.settings), stats),
        ws="none",
        lifespan="on",
        access_log=False,
        log_level=srv.log_level,
        timeout_graceful_shutdown=math.ceil(srv.shutdown_timeout_s + _BACKSTOP_S),
        timeout_keep_alive=math.ceil(srv.keepalive_timeout_s),
        backlog=BACKLOG,
        proxy_headers=False,
        server_header=False,
        date_header=False,
    )
    server = _Server(config, gateway, on_serving)
    server.run(sockets=listeners.sockets)
    return bool(server.started)
