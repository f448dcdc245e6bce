"""Real servers on free ports: the vLLM stand-in and gateways, each in its own process."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

PY = sys.executable
QOSGATE = [PY, "-m", "qosgate.cli"]  # the `qosgate` command, whatever venv runs the tests
MODEL = "Qwen/Qwen2.5-7B-Instruct"  # what the stand-in serves (the default profile's model)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_RESERVED: set[int] = set()
_PORTS = random.Random()  # per process: two test processes rarely start at the same port


def reserved_port() -> int:
    """A free port below the kernel's ephemeral range, for a server that binds it long after
    it is chosen (vLLM binds its HTTP port and its KV-event endpoint only once its engine is
    up, ~a minute later). ``free_port`` hands out an ephemeral port, which in that minute any
    process's ``bind(0)`` may take -- a second vLLM starting beside it did (``Address already
    in use``); no ``bind(0)`` ever returns one of these."""
    low = _PORTS.randrange(20000, 31000)
    for port in range(low, 32000):
        if port in _RESERVED:
            continue
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        _RESERVED.add(port)
        return port
    raise RuntimeError("no free port in 20000..32000")


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


@pytest.fixture(scope="session")
def tmp_session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gw")


@pytest.fixture(scope="session")
def standin(tmp_session: Path) -> Iterator[Server]:
    """The vLLM stand-in with priority scheduling, modelled time at real speed."""
    s = start_standin(tmp_session, "--scheduling-policy", "priority")
    yield s
    s.stop()


def http(
    method: str,
    url: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10,
) -> tuple[int, dict[str, str], bytes]:
    """A raw HTTP request: (status, lower-case headers, body), errors included."""
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, r.read()
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()


def metric_values(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of one metric: {sorted label pairs: value}."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        labels: list[tuple[str, str]] = []
        if "{" in head:
            body = head[head.index("{") + 1 : head.rindex("}")]
            for part in body.split('",'):
                if not part:
                    continue
                k, _, v = part.partition("=")
                labels.append((k, v.strip('"')))
        out[tuple(sorted(labels))] = float(value)
    return out


def wait_until(cond: Callable[[], object], timeout: float = 5.0, every: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if cond():
                return True
        time.sleep(every)
    return False
