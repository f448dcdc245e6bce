"""``qosgate top --once`` as a subprocess against a real gateway in front of two stand-ins, a dead
URL and a silent one; the live view in a terminal. (The frame from canned scrapes:
``tests/test_top.py``.)"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import select
import signal
import socket
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI, RateLimitError

from tests.support.httpclient import http
from tests.support.ports import free_port
from tests.support.processes import MODEL, QOSGATE, Server, start_gateway, start_standin
from tests.support.top_frame import row
from tests.support.waiting import wait_until

# ---------------------------------------------------------------- against a real gateway
CONFIG = """
tenants:
  - {{name: alice, api_keys: [sk-alice]}}
  - {{name: bob, api_keys: [sk-bob], limits: {{max_concurrent: 1}}}}
classes:
  - {{name: realtime, level: 0, strict: true, ttft_budget_ms: 1000, queue_timeout_s: 30,
     max_queue: 100, can_preempt: true}}
  - {{name: interactive, level: 1, weight: 5, ttft_budget_ms: 5000, queue_timeout_s: 60,
     max_queue: 100}}
  - {{name: bulk, level: 2, weight: 2, ttft_budget_ms: 60000, queue_timeout_s: 120,
     max_queue: 100, preemptible: true}}
default_class: interactive
aging: {{ceiling: interactive}}
task_types: {{chat: realtime}}
server: {{admin_keys: [sk-admin], metrics_auth: true}}
upstreams:
  - {{url: "{a}", name: engine-a, capacity: 2, priority_polarity: vllm}}
  - {{url: "{b}", name: engine-b, capacity: 2, priority_polarity: vllm}}
"""
CLASSES = ("realtime", "interactive", "bulk")
ADMIN = {"Authorization": "Bearer sk-admin"}


class Live:
    def __init__(self, tmp: Path) -> None:
        self.a = start_standin(tmp, "--scheduling-policy", "priority")
        try:
            self.b = start_standin(tmp, "--scheduling-policy", "priority")
        except Exception:
            self.a.stop()
            raise
        cfg = tmp / "top.yaml"
        cfg.write_text(CONFIG.format(a=self.a.url, b=self.b.url))
        try:
            self.gw = start_gateway(tmp, "--config", str(cfg))
        except Exception:  # a gateway that fails to start leaves no stand-in behind
            self.a.stop()
            self.b.stop()
            raise

    def close(self) -> None:
        self.gw.stop()
        self.a.stop()
        self.b.stop()


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    lv = Live(tmp_path_factory.mktemp("top"))
    yield lv
    lv.close()


def top(*args: str, env: dict[str, str] | None = None, timeout: float = 30
        ) -> subprocess.CompletedProcess[str]:
    """``qosgate top`` as a subprocess (stdout a pipe: the plain, fixed-width frame)."""
    e = {k: v for k, v in os.environ.items() if k != "QOSGATE_ADMIN_KEY"}
    return subprocess.run([*QOSGATE, "top", *args], capture_output=True, text=True,
                          timeout=timeout, env={**e, **(env or {})}, check=False)


def gw_status(gw: Server) -> dict[str, Any]:
    out: dict[str, Any] = json.loads(http("GET", gw.url + "/v1/qos/status", headers=ADMIN)[2])
    return out


@pytest.mark.e2e
def test_once_against_a_live_gateway_under_load(live: Live) -> None:
    """Completed requests in two classes from two tenants, a refusal (bob's concurrency cap),
    and two long streams still running when the frame is taken."""
    alice = OpenAI(base_url=live.gw.url + "/v1", api_key="sk-alice", max_retries=0)
    bob = OpenAI(base_url=live.gw.url + "/v1", api_key="sk-bob", max_retries=0)
    for cls in ("realtime", "interactive"):
        for _ in range(3):
            alice.chat.completions.create(model=MODEL, max_tokens=3, extra_headers={
                "x-qos-class": cls}, messages=[{"role": "user", "content": "hi"}])
    stop = threading.Event()
    streams = []

    def hold(client: OpenAI) -> None:
        s = client.chat.completions.create(model=MODEL, max_tokens=4000, stream=True,
                                           extra_headers={"x-qos-class": "bulk"},
                                           messages=[{"role": "user", "content": "hi"}])
        streams.append(s)
        for _ in s:
            if stop.is_set():
                break
        s.close()

    holders = [threading.Thread(target=hold, args=(c,)) for c in (alice, bob)]
    for t in holders:
        t.start()
    try:
        assert wait_until(lambda: gw_status(live.gw)["classes"]["bulk"]["inflight"] == 2,
                          timeout=20)
        with pytest.raises(RateLimitError):  # bob holds his one slot
            bob.chat.completions.create(model=MODEL, max_tokens=3,
                                        messages=[{"role": "user", "content": "hi"}])
        p = top(live.gw.url, "--once", env={"QOSGATE_ADMIN_KEY": "sk-admin"})
    finally:
        stop.set()
        for t in holders:
            t.join(30)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "\x1b[" not in out and max(len(ln) for ln in out.splitlines()) <= 120
    assert "1/1 gateway(s) answered" in out and "since start" in out
    for cls in CLASSES:
        assert row(out, "classes", cls)[0] == cls
    for cls in ("realtime", "interactive"):
        cells = row(out, "classes", cls)
        assert int(cells[6]) == 3 and int(cells[7]) == 3  # TTFT n, done
        assert cells[4].endswith(("ms", "s")) and cells[5].endswith(("ms", "s"))
    assert row(out, "classes", "bulk")[2] == "2"  # inflight
    assert row(out, "tenants", "alice")[1:5] == ["0", "1", "bulk", "6"]
    assert row(out, "tenants", "bob")[5] == "1"  # rejected
    reps = {name: row(out, "replicas", name) for name in ("engine-a", "engine-b")}
    assert all(r[1:4] == ["yes", "yes", "closed"] for r in reps.values())
    assert sum(int(r[4].split("/")[0]) for r in reps.values()) >= 2  # the two bulk streams
    assert all(r[4].endswith("/2") for r in reps.values())
    assert row(out, "gateways", live.gw.url)[2] == "ok"


@pytest.mark.e2e
def test_once_at_80_columns_prints_every_column_whole(live: Live) -> None:
    p = top(live.gw.url, "--once", "--key", "sk-admin", "--width", "80")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "…" not in out and max(len(ln) for ln in out.splitlines()) <= 80
    assert row(out, "gateways", live.gw.url)[2] == "ok"
    for name in ("engine-a", "engine-b"):
        cells = row(out, "replicas", name)
        assert cells[4].endswith("/2")  # inflight/window, whole
        assert row(out, "replicas (continued)", name)[0] == name
    for head in ("shared state", "attempt fails", "TTFT p50", "cancel"):
        assert head in out, head


@pytest.mark.e2e
def test_once_with_a_wrong_key_says_so_and_exits_1(live: Live) -> None:
    p = top(live.gw.url, "--once", "--key", "sk-nope")
    assert p.returncode == 1
    assert row(p.stdout, "gateways", live.gw.url)[2] == "REFUSED"
    assert "HTTP 401" in p.stderr and "check --key" in p.stderr


@pytest.mark.e2e
def test_a_dead_url_next_to_a_live_one(live: Live) -> None:
    dead = f"127.0.0.1:{free_port()}"
    p = top(live.gw.url, dead, "--once", "--key", "sk-admin", "--width", "150")
    assert p.returncode == 0, p.stderr
    assert row(p.stdout, "gateways", "http://" + dead)[2] == "UNREACHABLE"
    assert f"http://{dead}: connection refused" in p.stdout
    assert row(p.stdout, "replicas", "engine-a")[0] == "engine-a"
    assert max(len(ln) for ln in p.stdout.splitlines()) <= 150


@pytest.mark.e2e
def test_nothing_answers_exit_1() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    p = top(url, "--once")
    assert p.returncode == 1
    assert "Traceback" not in p.stdout + p.stderr
    assert row(p.stdout, "gateways", url)[2] == "UNREACHABLE"
    assert f"no gateway answered: {url}: connection refused" in p.stderr


@pytest.mark.e2e
def test_a_silent_gateway_times_out() -> None:
    """A socket that accepts connections (the kernel's backlog) and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        p = top(url, "--once", "--timeout", "0.5")
    assert p.returncode == 1
    assert f"{url}: no answer within 0.5s" in p.stdout


@pytest.mark.e2e
def test_workers_on_one_port_show_as_a_fleet(live: Live, tmp_path: Path) -> None:
    """``serve --workers 2 --redis``: one URL, two instances; the frame lists both from the
    shared state's fleet, whichever answered."""
    from tests.support.redis_server import RedisServer

    redis = RedisServer(tmp_path)
    cfg = tmp_path / "top.yaml"
    cfg.write_text(CONFIG.format(a=live.a.url, b=live.b.url))
    try:
        gw = start_gateway(tmp_path, "--config", str(cfg), "--redis", redis.url, "--workers",
                           "2", "--instance-id", "wk")
    except Exception:
        redis.stop()
        raise
    try:
        assert wait_until(lambda: len(gw_status(gw)["shared_state"]["fleet"]) == 2, timeout=15)
        p = top(gw.url, "--once", "--key", "sk-admin")
    finally:
        assert gw.stop() == 0
        redis.stop()
    assert p.returncode == 0, p.stderr
    # each worker scraped on its own (new connections reach the other one): a row each
    gws = [ln.split() for ln in p.stdout.splitlines() if ln.startswith(gw.url + " ")]
    assert [c[1] for c in gws] == ["wk-w0", "wk-w1"]
    assert all(c[2] == "ok" and c[-3:] == ["redis,", "2", "live"] for c in gws)
    for w in ("wk-w0", "wk-w1"):
        assert row(p.stdout, "fleet", w)[1:] == ["0", "0", gw.url, "yes"]
    first = p.stdout.split("replicas (continued)")[0]  # 120 columns: the table goes on below
    reps = [ln.split()[:2] for ln in first.splitlines() if ln.startswith("engine-")]
    assert sorted(reps) == [["engine-a", "wk-w0"], ["engine-a", "wk-w1"],
                            ["engine-b", "wk-w0"], ["engine-b", "wk-w1"]]


@pytest.mark.e2e
def test_metrics_on_their_own_port(live: Live, tmp_path: Path) -> None:
    """``server.metrics_port``: /metrics is not on the API port; ``--metrics-port`` finds it."""
    cfg = tmp_path / "top.yaml"
    cfg.write_text(CONFIG.format(a=live.a.url, b=live.b.url))
    mport = free_port()
    gw = start_gateway(tmp_path, "--config", str(cfg), "--metrics-port", str(mport))
    try:
        assert http("GET", gw.url + "/metrics", headers=ADMIN)[0] != 200
        without = top(gw.url, "--once", "--key", "sk-admin")
        with_port = top(gw.url, "--once", "--key", "sk-admin", "--metrics-port", str(mport))
    finally:
        gw.stop()
    assert without.returncode == 0  # the status answered
    assert row(without.stdout, "gateways", gw.url)[2:4] == ["no", "metrics"]
    assert with_port.returncode == 0, with_port.stderr
    assert row(with_port.stdout, "gateways", gw.url)[2] == "ok"
    assert row(with_port.stdout, "replicas", "engine-a")[1] == "yes"


def read_until(fd: int, marker: bytes, timeout: float = 20) -> bytes:
    """Read a pty's output until ``marker`` appears (or fail at the deadline)."""
    buf = b""
    deadline = time.monotonic() + timeout
    while marker not in buf:
        left = deadline - time.monotonic()
        assert left > 0, buf[-2000:].decode(errors="replace")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            buf += chunk
    return buf


def _ctrl_c_as_at_a_terminal() -> None:
    """In the child: SIGINT with its default meaning. A test run started in the background
    (``make test &``, nohup) ignores SIGINT, its children inherit that, and Python then never
    turns Ctrl-C into KeyboardInterrupt: ``top`` would rightly ignore it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def drain(read: Callable[[], bytes]) -> threading.Thread:
    """Keep reading a child's output until it closes: a child that ends writes to it (the
    frame it was drawing, the screen it restores), and with nobody reading, a full pipe or
    terminal would block it there, after Ctrl-C, forever."""
    def run() -> None:
        with contextlib.suppress(OSError, ValueError):
            while read():
                pass

    th = threading.Thread(target=run, daemon=True)
    th.start()
    return th


@pytest.mark.e2e
def test_live_view_in_a_terminal_refreshes_with_rates_and_stops_on_ctrl_c(live: Live) -> None:
    """In a pseudo-terminal: the alternate screen, a first cumulative frame, then frames with
    rates over the interval; SIGINT (Ctrl-C) ends it with status 0."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 160, 0, 0))
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([*QOSGATE, "top", live.gw.url, "--key", "sk-admin",
                             "--interval", "0.3"], stdin=slave, stdout=slave, stderr=slave,
                            env={**env, "TERM": "xterm-256color"}, close_fds=True,
                            preexec_fn=_ctrl_c_as_at_a_terminal)
    os.close(slave)
    try:
        out = read_until(master, b"since start")
        assert b"\x1b[?1049h" in out  # the alternate screen
        out += read_until(master, b"over the last")
        assert b"engine-a" in out and b"engine-b" in out and b"interactive" in out
        reader = drain(lambda: os.read(master, 65536))
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
        reader.join(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


@pytest.mark.e2e
def test_frames_to_a_pipe_are_a_log(live: Live) -> None:
    """Without --once and stdout not a terminal: one plain frame per interval."""
    proc = subprocess.Popen([*QOSGATE, "top", live.gw.url, "--key", "sk-admin", "--interval",
                             "0.3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=_ctrl_c_as_at_a_terminal)
    assert proc.stdout is not None
    lines: list[str] = []
    try:
        while sum("over the last" in ln for ln in lines) < 2:
            ln = proc.stdout.readline().decode()
            assert ln, lines
            lines.append(ln)
        out, err = proc.stdout, proc.stderr
        assert err is not None
        readers = [drain(lambda: out.read(65536)), drain(lambda: err.read(65536))]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
        for th in readers:
            th.join(5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text_ = "".join(lines)
    assert "\x1b[" not in text_
    assert text_.count("qosgate top ") == 3 and "since start" in text_
