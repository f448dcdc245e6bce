"""The real model behind the gateway: SmolLM2-135M-Instruct (Q4_1) via llama.cpp, on the CPU.

``InProcGateway`` serves a ``Gateway`` with uvicorn in a background thread of the test process, so
a test talks to it over HTTP with the official ``openai`` client and can still look at the engine
(slots, pauses) and the scheduler. ``Serve`` runs the real ``qosgate serve`` command.
Importing this module skips the importing test module where llama.cpp or the model is missing.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

import uvicorn
from openai import OpenAI

from qosgate.config import QosConfig, default_config
from qosgate.models.llamacpp import LlamaCppEngine, default_model_path
from qosgate.runtime.inprocess import InProcessEngine
from qosgate.server.app import Gateway
from qosgate.server.compose import build_gateway
from qosgate.settings import settings_from_mapping
from tests.support.ports import free_port
from tests.support.processes import Server, gateway_args
from tests.support.waiting import wait_until

try:
    MODEL_PATH = default_model_path()
except FileNotFoundError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(str(exc), allow_module_level=True)

MODEL = "smollm2-135m-instruct"


class InProcGateway:
    """A gateway with the llama.cpp engine, served by uvicorn in a thread (see the module doc)."""

    def __init__(self, cfg: QosConfig | None = None, **engine: Any) -> None:
        engine.setdefault("n_ctx", 512)
        engine.setdefault("n_threads", 2)
        self.port = free_port()
        # the port it serves on: its batch directory is the default for that address
        settings = settings_from_mapping({"engine": {"kind": "llamacpp", **engine},
                                          "server": {"port": self.port}})
        self.gateway: Gateway = build_gateway(cfg or default_config(), settings)
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self.gateway, host="127.0.0.1", port=self.port, loop="asyncio", http="httptools",
            lifespan="on", access_log=False, log_level="warning",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        if not wait_until(lambda: self.server.started, 30):
            raise RuntimeError("in-process gateway did not start")

    @property
    def replica(self) -> InProcessEngine:
        (eng,) = self.gateway.engines.values()
        assert isinstance(eng, InProcessEngine)
        return eng

    @property
    def llama(self) -> LlamaCppEngine:
        eng = self.replica.engine
        assert isinstance(eng, LlamaCppEngine)
        return eng

    def client(self, **kw: Any) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key="test", max_retries=0, **kw)

    def idle(self) -> bool:
        """Nothing in the scheduler, nothing in the engine, every slot free."""
        return (
            not self.gateway.driver.tickets
            and not self.llama._seqs
            and self.llama.free_slots() == self.llama.max_num_seqs
        )

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


class Serve(Server):
    """``qosgate serve`` as a subprocess on a free port (loading the model takes a while)."""

    def __init__(self, log: Path, *args: str) -> None:
        port = free_port()
        super().__init__(
            gateway_args(port, *args), port, "/readyz", log, ready_timeout=60, stop_timeout=20
        )

    def client(self, **kw: Any) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key="test", max_retries=0, **kw)
