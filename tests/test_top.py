"""``qosgate top``: the frame from canned scrapes (pure functions). ``qosgate top --once`` as a
subprocess against real gateways is ``tests/e2e/test_top.py``."""

from __future__ import annotations

import io
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
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
from tests.support.top_frame import row

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def text(r: RenderableType, width: int = 120) -> str:
    c = Console(width=width, file=io.StringIO(), color_system=None, record=True)
    c.print(r)
    return c.export_text()


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
    """Between the two scrapes 5 more completed, all slow: the window's p50 is slow although
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
    """The names top.py reads are in the registry the board, rules and docs are checked
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
