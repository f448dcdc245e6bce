"""The real model behind the gateway: SmolLM2-135M-Instruct (Q4_1) via llama.cpp, on the CPU.

``InProcGateway`` serves a ``Gateway`` with uvicorn in a background thread of the test process, so
a test talks to it over HTTP with the official ``openai`` client and can still look at the engine
(slots, pauses) and the scheduler. ``start_serve`` runs the real ``qosgate serve`` command.
Everything is kept small (max_tokens <= 64, a few requests): the folder runs on 2 busy cores.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")

import uvicorn
from openai import OpenAI

from qosgate.config import QosConfig, default_config
from qosgate.engines.inprocess import InProcessEngine
from qosgate.engines.llamacpp import LlamaCppEngine, default_model_path
from qosgate.server.app import Gateway
from qosgate.server.run import build_gateway
from qosgate.server.settings import settings_from_mapping

try:
    MODEL_PATH = default_model_path()
except FileNotFoundError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(str(exc), allow_module_level=True)

MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(cond: Callable[[], object], timeout: float = 20.0, every: float = 0.01) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if cond():
                return True
        time.sleep(every)
    return False


class InProcGateway:
    """A gateway with the llama.cpp engine, served by uvicorn in a thread (see the module doc)."""

    def __init__(self, cfg: QosConfig | None = None, **engine: Any) -> None:
        engine.setdefault("n_ctx", 512)
        engine.setdefault("n_threads", 2)
        settings = settings_from_mapping({"engine": {"kind": "llamacpp", **engine}})
        self.gateway: Gateway = build_gateway(cfg or default_config(), settings)
        self.port = free_port()
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


@pytest.fixture
def gateway_factory() -> Iterator[Callable[..., InProcGateway]]:
    made: list[InProcGateway] = []

    def make(cfg: QosConfig | None = None, **engine: Any) -> InProcGateway:
        gw = InProcGateway(cfg, **engine)
        made.append(gw)
        return gw

    yield make
    for gw in made:
        gw.stop()


class Serve:
    """``qosgate serve`` as a subprocess on a free port."""

    def __init__(self, log: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._f = log.open("wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="200")
        cmd = [sys.executable, "-m", "qosgate.cli", "serve", "--port", str(self.port),
               "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._f, stderr=subprocess.STDOUT, env=env)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"qosgate serve exited: {log.read_text()}")
            with urllib.request.urlopen(self.url + "/readyz", timeout=1) as r:
                return bool(r.status == 200)

        ok = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not ok:
            try:
                ok = ready()
            except RuntimeError:
                raise
            except OSError:
                time.sleep(0.05)
        if not ok:
            self.stop()
            raise RuntimeError(f"qosgate serve not ready: {log.read_text()}")

    def client(self, **kw: Any) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key="test", max_retries=0, **kw)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._f.close()
        return self.proc.returncode
