"""``qosgate top``: the frame from canned scrapes (pure functions), then ``qosgate top --once`` as
a subprocess against a real gateway in front of two stand-ins, a dead URL and a silent one."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import pty
import re
import select
import signal
import socket
import struct
import subprocess
import termios
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI, RateLimitError
from rich.console import Console, RenderableType

from qosgate import metric_names
from qosgate.top import view as top_view
from qosgate.top.fetch import normalize_url
from qosgate.top.view import (
    OUTCOME_HEADS,
    Scrape,
    frame,
    histogram_quantile,
    increase,
    parse_metrics,
)
from tests.support.httpclient import http
from tests.support.ports import free_port
from tests.support.processes import MODEL, QOSGATE, Server, start_gateway, start_standin
from tests.support.waiting import wait_until

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def text(r: RenderableType, width: int = 120) -> str:
    c = Console(width=width, file=io.StringIO(), color_system=None, record=True)
    c.print(r)
    return c.export_text()


def row(frame_text: str, section: str, first: str) -> list[str]:
    """The cells of the row named ``first`` in the table titled ``section``."""
    lines = frame_text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(section))
    for ln in lines[start + 1:]:
        cells = ln.split()
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} under {section!r}:\n{frame_text}")


# ---------------------------------------------------------------- canned scrapes
def status(instance: str = "gw-a", queued: int = 2, fleet: dict[str, Any] | None = None
           ) -> dict[str, Any]:
    st: dict[str, Any] = {
        "policy": "qos",
        "classes": {
            "realtime": {"queued": 0, "inflight": 1, "oldest_wait_s": 0.0},
            "batch": {"queued": queued, "inflight": 3, "oldest_wait_s": 4.25},
        },
        "tenants": {"alice": {"classes": {"batch": {}}, "queued": queued, "inflight": 3,
                              "oldest_wait_s": 4.25}},
        "replicas": {
            "r1": {"capacity": 4, "inflight": 4, "models": ["m"], "up": True, "eligible": True,
                   "breaker": "closed", "ejections": 0, "cooling_s": 0.0},
            "r2": {"capacity": 4, "inflight": 0, "models": ["m"], "up": False,
                   "eligible": False, "breaker": "open", "ejections": 2, "cooling_s": 3.5},
        },
        "queued_total": queued, "free_slots": 4, "accepting": True, "instance": instance,
        "shared_state": {"store": "none"},
    }
    if fleet is not None:
        st["shared_state"] = {"store": "redis", "degraded": False, "fail_open": True,
                              "live_instances": len(fleet), "fleet": fleet}
    return st


def metrics(instance: str = "gw-a", done: int = 10, refused: int = 1, fast: int = 10,
            slow: int = 0) -> str:
    """``fast`` realtime first tokens under 25 ms, ``slow`` ones between 1 and 2.5 s."""
    n = fast + slow
    req = "qosgate_requests_total"
    return f"""\
# TYPE qosgate_requests counter
{req}{{class="realtime",outcome="completed",reason="completed",tenant="alice"}} {done}
{req}{{class="batch",outcome="rejected",reason="tenant_concurrency",tenant="bob"}} {refused}
{req}{{class="batch",outcome="timed_out",reason="queue_timeout",tenant="bob"}} 3
# TYPE qosgate_ttft_seconds histogram
qosgate_ttft_seconds_bucket{{class="realtime",le="0.01"}} 0
qosgate_ttft_seconds_bucket{{class="realtime",le="0.025"}} {fast}
qosgate_ttft_seconds_bucket{{class="realtime",le="1.0"}} {fast}
qosgate_ttft_seconds_bucket{{class="realtime",le="2.5"}} {n}
qosgate_ttft_seconds_bucket{{class="realtime",le="+Inf"}} {n}
qosgate_ttft_seconds_count{{class="realtime"}} {n}
qosgate_ttft_seconds_sum{{class="realtime"}} 1.0
# TYPE qosgate_retries counter
qosgate_retries_total{{class="batch",replica="r2",reason="upstream_unreachable"}} 5
# TYPE qosgate_attempt_failures counter
qosgate_attempt_failures_total{{class="batch",replica="r2",reason="upstream_unreachable"}} 7
# TYPE qosgate_instance_info gauge
qosgate_instance_info{{instance="{instance}",shared_state="none"}} 1
"""


def scrape(at: float = 100.0, **kw: Any) -> Scrape:
    inst = kw.pop("instance", "gw-a")
    return Scrape("http://gw:8000", at, status(inst), None, parse_metrics(metrics(inst, **kw)))


def test_histogram_quantile_as_prometheus() -> None:
    b = [(0.1, 5.0), (0.5, 10.0), (float("inf"), 10.0)]
    assert histogram_quantile(0.5, b) == pytest.approx(0.1)
    assert histogram_quantile(0.99, b) == pytest.approx(0.1 + 0.4 * 4.9 / 5)
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None
    assert histogram_quantile(0.99, [(0.1, 1.0), (float("inf"), 10.0)]) == 0.1  # in +Inf


def test_increase_new_series_and_restart() -> None:
    before = parse_metrics(metrics(done=10, refused=1))
    after = parse_metrics(metrics(done=4, refused=3))  # done went down: the instance restarted
    got = {(lab["outcome"]): v for lab, v in increase(after, before, "qosgate_requests_total")}
    assert got == {"completed": 4, "rejected": 2, "timed_out": 0}
    assert {lab["outcome"]: v for lab, v in increase(after, None, "qosgate_requests_total")} == {
        "completed": 4, "rejected": 3, "timed_out": 3}


def test_first_frame_is_cumulative_and_names_everything() -> None:
    out = text(frame([scrape()], now=NOW))
    assert "2026-01-02 03:04:05 UTC" in out and "1/1 gateway(s) answered" in out
    assert "since start (cumulative: first frame)" in out
    # class, queued, inflight, oldest, p50, p99, n, done, rejected, timeout, failed, cancel
    assert row(out, "classes", "realtime") == [
        "realtime", "0", "1", "-", "18ms", "25ms", "10", "10", "0", "0", "0", "0"]
    assert row(out, "classes", "batch") == [
        "batch", "2", "3", "4.2s", "-", "-", "0", "0", "1", "3", "0", "0"]
    assert row(out, "tenants", "alice") == ["alice", "2", "3", "batch", "10", "0", "0", "0"]
    assert row(out, "tenants", "bob") == ["bob", "0", "0", "-", "0", "1", "3", "0"]
    # replica, up, eligible, breaker, inflight/window, cooling, ejections, retries, fails, p50
    assert row(out, "replicas", "r1") == ["r1", "yes", "yes", "closed", "4/4", "-", "0", "0",
                                          "0", "-"]
    assert row(out, "replicas", "r2") == ["r2", "NO", "NO", "open", "0/4", "3.5s", "2", "5",
                                          "7", "-"]
    assert row(out, "gateways", "http://gw:8000")[1:3] == ["gw-a", "ok"]


def test_second_frame_counts_and_ttft_over_the_interval() -> None:
    """Between the two scrapes 5 more completed, all slow: the span's p50 is slow although
    most requests since start were fast."""
    first = scrape(at=100.0)
    second = scrape(at=101.5, done=15, refused=1, fast=10, slow=5)
    out = text(frame([second], {first.key: first}, now=NOW))
    assert "over the last 1.5s (between two scrapes)" in out
    cells = row(out, "classes", "realtime")
    assert cells[4:12] == ["1.8s", "2.5s", "5", "+5/15", "0", "0", "0", "0"]
    assert row(out, "classes", "batch")[7:10] == ["0", "+0/1", "+0/3"]
    cumulative = row(text(frame([second], now=NOW)), "classes", "realtime")
    assert cumulative[4:8] == ["21ms", "2.5s", "15", "15"]


def test_workers_behind_one_url_count_against_their_own_previous_scrape() -> None:
    """Two workers answer one URL in turn: a scrape of w1 has no previous scrape of w1, so the
    frame stays cumulative instead of subtracting w0's counters from w1's."""
    w0 = scrape(instance="w0", done=10)
    w1 = scrape(at=101.0, instance="w1", done=3)
    out = text(frame([w1], {w0.key: w0}, now=NOW))
    assert "since start" in out
    assert row(out, "classes", "realtime")[7] == "3"


def test_several_gateways_sum_classes_and_list_replicas_per_gateway() -> None:
    a, b = scrape(instance="gw-a"), scrape(instance="gw-b", done=5, fast=5)
    b.url = "http://gw2:8000"
    out = text(frame([a, b], now=NOW), width=140)
    assert "2/2 gateway(s) answered" in out
    assert row(out, "classes", "realtime")[1:3] == ["0", "2"]
    assert row(out, "classes", "realtime")[6:8] == ["15", "15"]
    assert row(out, "classes", "batch")[1:4] == ["4", "6", "4.2s"]
    reps = [ln.split()[:2] for ln in out.splitlines() if ln.startswith(("r1 ", "r2 "))]
    assert sorted(reps) == [["r1", "gw-a"], ["r1", "gw-b"], ["r2", "gw-a"], ["r2", "gw-b"]]


def test_fleet_of_shared_state_is_listed() -> None:
    fleet = {"host-w0": {"queued_total": 2, "inflight": 7},
             "host-w1": {"queued_total": 0, "inflight": 3}}
    s = Scrape("http://gw:8000", 1.0, status("host-w0", fleet=fleet), None,
               parse_metrics(metrics("host-w0")))
    out = text(frame([s], now=NOW))
    assert row(out, "gateways", "http://gw:8000")[-3:] == ["redis,", "2", "live"]
    assert row(out, "fleet", "host-w0") == ["host-w0", "2", "7", "http://gw:8000", "yes"]
    assert row(out, "fleet", "host-w1") == ["host-w1", "0", "3", "http://gw:8000"]


def test_batch_jobs_are_listed_with_the_lines_each_gateway_runs() -> None:
    job = {"id": "batch_1", "tenant": "alice", "status": "in_progress", "class": "batch",
           "endpoint": "/v1/chat/completions", "total": 5000, "completed": 1200, "failed": 3,
           "created_at": 0, "expires_at": NOW.timestamp() + 3600}
    a = Scrape("http://a:8000", 1.0, dict(status("gw-a"), batches=[dict(job, in_flight=20)]),
               None, parse_metrics(metrics("gw-a")))
    b = Scrape("http://b:8000", 1.0, dict(status("gw-b"), batches=[dict(job, in_flight=5)]),
               None, parse_metrics(metrics("gw-b")))
    assert "batch jobs" not in text(frame([scrape()], now=NOW))  # none: no table
    cells = row(text(frame([a, b], now=NOW)), "batch jobs", "batch_1")
    assert cells == ["batch_1", "alice", "batch", "in_progress", "1200", "3", "5000", "25",
                     "3600s"]


def test_unreachable_and_refused_gateways_are_rows_not_tracebacks() -> None:
    dead = Scrape("http://dead:1", 1.0, status_error="connection refused",
                  metrics_error="connection refused")
    locked = Scrape("http://locked:2", 1.0, status_error="HTTP 401: Missing API key.",
                    metrics_error="HTTP 401: Missing API key.")
    out = text(frame([dead, locked], now=NOW))
    assert "0/2 gateway(s) answered" in out
    assert row(out, "gateways", "http://dead:1")[2] == "UNREACHABLE"
    assert row(out, "gateways", "http://locked:2")[2] == "REFUSED"
    assert "http://dead:1: connection refused" in out
    assert "classes" not in out
    half = Scrape("http://gw:8000", 1.0, status(), None, None, "HTTP 401: no key")
    out = text(frame([half], now=NOW))
    assert row(out, "gateways", "http://gw:8000")[2:4] == ["no", "metrics"]
    assert "http://gw:8000 /metrics: HTTP 401: no key" in out
    assert row(out, "replicas", "r1")[4] == "4/4"  # the status alone still fills the view


def test_frame_at_80_columns_continues_below_instead_of_cutting() -> None:
    """``qosgate top --width 80``: a table too wide goes on below with its name columns
    repeated; no cell is cut short, no column dropped."""
    a, b = scrape(instance="gw-a"), scrape(instance="gw-b", done=5, fast=5)
    b.url = "http://gateway-two.example.internal:8000"
    out = text(frame([a, b], now=NOW), width=80)
    assert "…" not in out
    assert max(len(ln) for ln in out.splitlines()) <= 80
    for head in ("url", "instance", "state", "policy", "queued", "inflight", "free slots",
                 "shared state", "class", "oldest", "TTFT p50", "TTFT p99", *OUTCOME_HEADS,
                 "tenant", "classes now", "replica", "gateway", "up", "eligible", "breaker",
                 "inflight/window", "cooling", "ejections", "retries", "attempt fails"):
        assert re.search(rf"(^|\s){re.escape(head)}(\s|$)", out, re.M), head
    assert "http://gateway-two.example.internal:8000" in out
    assert "classes (continued)" in out and "replicas (continued)" in out
    # each part of the replicas table names the replica and the gateway of every row
    reps = [ln.split()[:2] for ln in out.splitlines() if ln.startswith(("r1 ", "r2 "))]
    assert len(reps) == 8 and all(g in ("gw-a", "gw-b") for _, g in reps)
    assert row(out, "classes", "realtime")[:8] == [
        "realtime", "0", "2", "-", "18ms", "25ms", "15", "15"]


def test_every_metric_top_reads_is_registered() -> None:
    """The names top/view.py reads are in the registry the board, rules and docs are checked
    against (a renamed metric fails here, not silently as an empty column)."""
    src = Path(top_view.__file__).read_text()
    names = set(re.findall(r'"(qosgate_[a-z_]+)"', src))
    assert {"qosgate_requests_total", "qosgate_ttft_seconds", "qosgate_retries_total"} <= names
    for name in names:
        fam = metric_names.family_of(name)
        assert fam is not None, name
    for name, label in (("qosgate_requests_total", "outcome"), ("qosgate_requests_total",
                        "tenant"), ("qosgate_ttft_seconds", "class"),
                        ("qosgate_retries_total", "replica"),
                        ("qosgate_replica_ttft_seconds", "replica")):
        fam = metric_names.family_of(name)
        assert fam is not None and label in fam.labels, (name, label)


def test_normalize_url() -> None:
    assert normalize_url("127.0.0.1:8000/") == "http://127.0.0.1:8000"
    assert normalize_url("https://gw.example") == "https://gw.example"


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
