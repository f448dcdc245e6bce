"""A real ``redis-server`` on a free loopback port with a temp dir (no persistence).

Missing ``redis-server``: the tests skip on a developer's machine but FAIL in CI (``CI=true``),
where ``.ci/run`` (``make test``) installs it first (scripts/apt_env.sh).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from tests.support.ports import free_port
from tests.support.waiting import wait_until


def redis_binary() -> str:
    path = shutil.which("redis-server")
    if path is None:
        msg = "redis-server is not installed (apt-get install -y redis-server; make test does)"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(msg)
        pytest.skip(msg)
    return path


def ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, tmp: Path, port: int | None = None) -> None:
        self.binary = redis_binary()
        self.port = port if port is not None else free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.dir = tmp / f"redis-{self.port}"
        self.dir.mkdir(exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self._log = (self.dir / "redis.log").open("ab")
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
             str(self.dir), "--save", "", "--appendonly", "no", "--protected-mode", "no"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        if not wait_until(lambda: ping(self.port), timeout=10):
            raise RuntimeError("redis-server did not start: "
                               + (self.dir / "redis.log").read_text())

    def kill(self) -> None:
        """SIGKILL: Redis disappears at once (its state with it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._log.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self._log.close()
