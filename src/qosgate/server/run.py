"""Build the gateway from config and serve it with uvicorn (uvloop + httptools).

Graceful shutdown on SIGTERM (or Ctrl+C): stop accepting connections, reject every queued request
with 503 + Retry-After at once, let running requests finish for up to ``shutdown_timeout_s``
(then they are cut), close the engines and exit 0. A second signal forces the exit.
"""

from __future__ import annotations

import asyncio
import logging
import math
from types import FrameType
from typing import Any

import uvicorn

from qosgate.config import QosConfig
from qosgate.engines.base import Engine
from qosgate.engines.embedded import llamacpp_replica
from qosgate.engines.inprocess import InProcessEngine
from qosgate.engines.openai_upstream import OpenAIUpstream
from qosgate.engines.simmodel import SimEngine, load_profile
from qosgate.server.app import Gateway
from qosgate.server.settings import GatewaySettings

DEFAULT_SIM_WINDOW = 64


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
        llama = llamacpp_replica(
            model=es.model, capacity=es.capacity, max_num_seqs=es.max_num_seqs, n_ctx=es.n_ctx,
            n_threads=es.n_threads, served_model_name=es.served_model_name,
            evict_paused=es.evict_paused, pausable=es.pausable,
        )
        return {llama.name: llama}
    prof = load_profile(es.profile)
    if es.max_num_seqs is not None:
        prof = prof.model_copy(update={"max_num_seqs": es.max_num_seqs})
    # the engine orders by the band too (vLLM polarity) when its KV cache is contended
    sim = SimEngine(prof, "priority")
    engines["sim-0"] = InProcessEngine(
        sim,
        name="sim-0",
        capacity=es.capacity or min(prof.max_num_seqs, DEFAULT_SIM_WINDOW),
        models=[es.served_model_name or "qosgate-sim"],
        modelled_time=True,
        time_scale=es.time_scale,
        pausable=es.pausable,
    )
    return engines


def build_gateway(cfg: QosConfig, settings: GatewaySettings, policy: str | None = None) -> Gateway:
    return Gateway(cfg, settings, build_engines(settings), policy)


class _Server(uvicorn.Server):
    """uvicorn, with the gateway's drain on the first signal and a clean exit code."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # not recorded in _captured_signals: uvicorn would re-raise it after serving, and the
        # process would die of the signal instead of exiting 0
        if self.should_exit:
            self.force_exit = True
            return
        self.should_exit = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.gateway.begin_shutdown)


def serve(gateway: Gateway, host: str, port: int, log_level: str = "info") -> bool:
    """Serve until a signal; True if the server started (and so shut down cleanly)."""
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:  # pragma: no cover
        loop = "asyncio"
    config = uvicorn.Config(
        gateway,
        host=host,
        port=port,
        loop=loop,
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level=log_level.lower(),
        timeout_graceful_shutdown=math.ceil(gateway.settings.server.shutdown_timeout_s),
        timeout_keep_alive=30,
        backlog=4096,
        proxy_headers=False,
        server_header=False,
        date_header=False,
    )
    server = _Server(config, gateway)
    server.run()
    return bool(server.started)

