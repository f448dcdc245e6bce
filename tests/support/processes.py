"""Real servers on free ports, each in its own process: the vLLM stand-in and gateways
(``qosgate serve``), run by whatever interpreter runs the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tests.support.httpclient import http
from tests.support.ports import free_port

PY = sys.executable


QOSGATE = [PY, "-m", "qosgate.cli"]  # the `qosgate` command, whatever venv runs the tests


MODEL = "Qwen/Qwen2.5-7B-Instruct"  # what the stand-in serves (the default profile's model)


class Server:
    """A server process on ``port``, ready once ``ready_path`` answers 200; ``stop`` sends SIGTERM
    (a model that loads, or requests that drain, may want the longer timeouts)."""

    def __init__(
        self,
        args: list[str],
        port: int,
        ready_path: str,
        log: Path,
        ready_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        self.stop_timeout = stop_timeout
        self._log_f = log.open("wb")
        # a gateway keeps batch jobs under $XDG_STATE_HOME/qosgate: each server its own, in
        # the test's tmp dir (a config's batches.dir still wins; ``env`` wins over both)
        self.proc = subprocess.Popen(args, stdout=self._log_f, stderr=subprocess.STDOUT, env={
            **os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200",
            "XDG_STATE_HOME": str(log.parent / f"state-{port}"), **(env or {})})
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {log.read_text()}")
            try:
                with urllib.request.urlopen(self.url + ready_path, timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server not ready: {log.read_text()}")
            time.sleep(0.05)

    def http(self, method: str, url: str, body: bytes | None = None,
             headers: dict[str, str] | None = None, timeout: float = 10,
             ) -> tuple[int, dict[str, str], bytes]:
        """``httpclient.http``: a raw request to this server (or any URL)."""
        return http(method, url, body, headers, timeout)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_f.close()
        return self.proc.returncode


def start_standin(tmp: Path, *args: str) -> Server:
    port = free_port()
    return Server(
        [PY, "-m", "qosgate.standin", "--port", str(port), *args],
        port,
        "/health",
        tmp / f"standin-{port}.log",
    )


def gateway_args(port: int, *args: str) -> list[str]:
    return [*QOSGATE, "serve", "--port", str(port), "--log-level", "warning", *args]


def start_gateway(tmp: Path, *args: str, port: int | None = None,
                  env: dict[str, str] | None = None) -> Server:
    """A gateway on ``port`` (default: a free one); ``env``: its environment's additions (e.g.
    one ``XDG_STATE_HOME`` for gateways that must meet there, or a restart on its address)."""
    port = free_port() if port is None else port
    log = tmp / f"gateway-{port}-{time.monotonic_ns()}.log"
    return Server(gateway_args(port, *args), port, "/readyz", log, env=env)


def gateway_from(tmp: Path, name: str, config: str) -> Iterator[Server]:
    """A gateway started from ``config`` (written to ``tmp/name``), stopped after the yield: the
    body of a fixture."""
    path = tmp / name
    path.write_text(config)
    gw = start_gateway(tmp, "--config", str(path))
    yield gw
    gw.stop()
