"""Serve the gateway (built by ``server/compose.py``) with uvicorn (uvloop + httptools).

Start-up order: the listening sockets are bound first (a port in use stops start-up before a
model is loaded), then the engines are built, then uvicorn serves on those sockets, and only once
it does is "serving on" printed (``on_serving``).

Connections go through ``server/protocol.py`` (a connection cap, header and body timeouts, a
header size cap, OpenAI-format answers to malformed HTTP). The cap defaults to the process's
descriptor limit (raised to its hard limit at start-up) less a reserve for the engines'
connections and the process's own files.

Graceful shutdown on SIGTERM (or Ctrl+C), in order: ``/readyz`` answers 503 (``draining``) and
the listeners stay open -- a load balancer still reaching the pod gets an answer, not a refused
connection -- while ``/health`` stays 200; for ``drain_delay_s`` (default 0) requests are still
served as usual, so that a load balancer that follows ``/readyz`` stops routing here first; then
every new request, every queued one and every one sent to an upstream engine that has sent
nothing back yet (its engine call is cancelled, which aborts it there) gets 503
``shutting_down`` with ``Retry-After`` at once; running requests finish for up to
``shutdown_timeout_s``, then the ones still running are cut -- a stream ends with an OpenAI error
event (``server_shutdown``) and ``[DONE]``, each counted once. Once no request is left the
listeners close, the engines close and the process exits 0.

A second SIGTERM or SIGINT exits at once, with one log line and the status 128 + the signal's
number (143, or 130 for Ctrl+C), as a shell reports a process killed by it. SIGHUP reloads the
config file (``Gateway.reload``: tenants, keys, limits; a file that cannot be applied is refused
with its reason logged, and the running config kept).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import resource
import signal
import socket
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

from qosgate.server.app import Gateway
from qosgate.server.protocol import ConnectionLimits, ConnectionStats, guarded_protocol
from qosgate.settings import GatewaySettings, ServerSettings

log = logging.getLogger("qosgate.gateway")

BACKLOG = 4096
# descriptors kept back from the connection cap: the process's own files, the model, the event
# loop, the log -- and, for upstreams, one connection per request in each replica's window
FD_RESERVE = 64
# uvicorn's own cut, after ours: only if ours could not end a request (it should not happen)
_BACKSTOP_S = 5.0


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
    reserve = FD_RESERVE + sum(u.max_window for u in settings.upstreams)
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
    """uvicorn, with the gateway's drain on the first signal (the listeners stay open until no
    request is left), its cut of running requests at the shutdown timeout, a forced exit on a
    second signal, SIGHUP a reload of the config, "serving on" once it serves, and a clean exit
    code."""

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
        self.stopping = False  # the first SIGTERM or SIGINT came
        self._cut: asyncio.TimerHandle | None = None
        self._drain: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        if threading.current_thread() is not threading.main_thread():
            await super().serve(sockets)
            return
        hangup = signal.signal(signal.SIGHUP, self.handle_hangup)
        try:
            await super().serve(sockets)
        finally:
            signal.signal(signal.SIGHUP, hangup)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit and self.on_serving is not None:
            self.on_serving()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not recorded in _captured_signals: uvicorn would re-raise it after serving, and the
        # process would die of the signal instead of exiting 0
        if self.stopping:
            self.force(sig)
        self.stopping = True
        if self.loop is None:  # not serving yet: nothing to drain
            self.should_exit = True
            return
        self.loop.call_soon_threadsafe(self._leave)

    def handle_hangup(self, sig: int, frame: FrameType | None) -> None:
        """SIGHUP: reload the config file, on the event loop (never from inside the handler,
        which may run between two steps of a request's admission)."""
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.gateway.reload_now)

    def force(self, sig: int) -> None:
        """A second signal: exit now, without the engines' close or uvicorn's wait (no
        traceback: nothing is unwound), with one line saying what was cut."""
        code = 128 + sig
        log.warning("second %s: exiting now with %d, cutting %d running request(s)",
                    signal.Signals(sig).name, code, len(self.gateway.driver.tickets))
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(code)

    def _leave(self) -> None:
        """The first signal: /readyz answers 503 from now; the drain begins after
        ``drain_delay_s``, while a load balancer stops routing here and requests are served."""
        self.gateway.leaving = True
        delay = self.gateway.settings.server.drain_delay_s
        if delay <= 0:
            self._begin_drain()
            return
        log.warning("leaving: /readyz answers 503; requests are served for %g s more "
                    "(server.drain_delay_s), then the drain begins", delay)
        assert self.loop is not None
        self.loop.call_later(delay, self._begin_drain)

    def _begin_drain(self) -> None:
        self.gateway.begin_shutdown()
        assert self.loop is not None
        self._cut = self.loop.call_later(
            self.gateway.settings.server.shutdown_timeout_s, self.cut_running
        )
        self._drain = self.loop.create_task(self._exit_once_settled())

    async def _exit_once_settled(self) -> None:
        """No request is left (they finished, or were cut): close the listeners and exit."""
        await self.gateway.driver.settled()
        if self._cut is not None:
            self._cut.cancel()
        log.info("drained: no request left; closing the listeners")
        self.should_exit = True

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
