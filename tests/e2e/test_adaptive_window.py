"""Adaptive windows and least-load routing end to end: a real gateway in front of stand-ins whose
batch (``--max-num-seqs``) is far smaller than the configured capacity.

- Under a flood, the gateway's window for the replica (``qosgate_replica_capacity``) comes down
  from where it started and stays near the engine's batch, not at the configured capacity; the
  engine's own queue (``vllm:num_requests_waiting``) stays small while it is kept busy, and the
  backlog waits in qosgate's queue (``qosgate_queue_depth``), where the scheduler decides.
- With a fast and a slow replica (the slow one listed first), least-load routing sends the fast
  one more of the work.

Every wait is on a condition, bounded.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import MODEL, Server, start_gateway, start_standin
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

BATCH = 4  # the stand-ins' --max-num-seqs
CAPACITY = 64  # the configured capacity: what a fixed window would be
INITIAL = 16  # where the adaptive window starts (above the batch: it must come down)


def _gateway(tmp: Path, urls: list[str], name: str) -> Server:
    cfg = {
        "upstreams": [{"url": u, "name": f"r{i}", "max_window": CAPACITY,
                       "priority_polarity": "vllm"} for i, u in enumerate(urls)],
        # faster loops than the defaults (settle/cooldown 2 s) keep the test short; the probe
        # still scrapes once a second
        "fleet": {"router": "least-load",
                  "window": {"mode": "adaptive", "initial": INITIAL, "settle_s": 1.0,
                             "cooldown_s": 1.0}},
    }
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return start_gateway(tmp, "--config", str(path))


def _flood(url: str, n: int, max_tokens: int) -> list[threading.Thread]:
    """``n`` batch-class requests at once, each on its own thread; they end when answered or
    when the gateway goes away."""
    body = json.dumps({"model": MODEL, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "x" * 400}]}).encode()
    headers = {"Content-Type": "application/json", "x-qos-class": "batch"}

    def go() -> None:
        with contextlib.suppress(Exception):  # the gateway went away at the end
            http("POST", url + "/v1/chat/completions", body, headers, timeout=120)

    threads = [threading.Thread(target=go, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def _scrape(url: str) -> str:
    status, _, body = http("GET", url + "/metrics")
    assert status == 200
    return body.decode()


def _one(text: str, name: str, **labels: str) -> float:
    return sum(v for k, v in metric_values(text, name).items()
               if all((lk, lv) in k for lk, lv in labels.items()))


@pytest.fixture
def single(tmp_path: Path) -> Iterator[tuple[Server, Server]]:
    si = start_standin(tmp_path, "--scheduling-policy", "priority", "--max-num-seqs", str(BATCH),
                       "--time-scale", "4")
    gw = _gateway(tmp_path, [si.url], "single")
    yield gw, si
    gw.stop()
    si.stop()


def test_window_converges_near_the_engine_batch_and_the_backlog_stays_in_qosgate(
        single: tuple[Server, Server]) -> None:
    gw, si = single
    assert _one(_scrape(gw.url), "qosgate_replica_capacity", replica="r0") == INITIAL
    _flood(gw.url, 100, 48)
    # the first dispatch fills the window past the batch: the engine queues the rest
    assert wait_until(lambda: _one(_scrape(si.url), "vllm:num_requests_waiting") >= BATCH,
                      timeout=10, every=0.1)

    def converged() -> bool:
        g, e = _scrape(gw.url), _scrape(si.url)
        return (_one(g, "qosgate_replica_capacity", replica="r0") <= 2 * BATCH
                and _one(e, "vllm:num_requests_waiting") <= 1
                and _one(g, "qosgate_queue_depth") >= 20)

    assert wait_until(converged, timeout=40, every=0.25), (_scrape(gw.url), _scrape(si.url))
    # and it holds: the next 12 readings of both sides (one scrape a second feeds the window)
    windows, waiting, running, queued = [], [], [], []

    def sample() -> bool:
        g, e = _scrape(gw.url), _scrape(si.url)
        windows.append(_one(g, "qosgate_replica_capacity", replica="r0"))
        queued.append(_one(g, "qosgate_queue_depth"))
        waiting.append(_one(e, "vllm:num_requests_waiting"))
        running.append(_one(e, "vllm:num_requests_running"))
        return len(windows) >= 12

    assert wait_until(sample, timeout=20, every=0.25)
    assert all(1 <= w <= 2 * BATCH for w in windows), windows  # not the capacity (64)
    assert max(waiting) <= 3, waiting  # the engine's queue stays small...
    assert min(queued) >= 10, queued  # ...while qosgate holds the backlog
    # and the engine is kept busy: its batch full in most readings
    assert sum(r == BATCH for r in running) >= len(running) // 2, running


@pytest.fixture
def fast_and_slow(tmp_path: Path) -> Iterator[tuple[Server, Server, Server]]:
    common = ("--scheduling-policy", "priority", "--max-num-seqs", str(BATCH),
              "--time-scale", "4")
    slow = start_standin(tmp_path, *common, "--slow", "4")
    fast = start_standin(tmp_path, *common)
    gw = _gateway(tmp_path, [slow.url, fast.url], "two")  # the slow one listed first: r0
    yield gw, slow, fast
    gw.stop()
    fast.stop()
    slow.stop()


def test_least_load_sends_the_faster_replica_more_work(
        fast_and_slow: tuple[Server, Server, Server]) -> None:
    gw, slow, fast = fast_and_slow

    def finished(s: Server) -> float:
        return _one(_scrape(s.url), "vllm:request_success_total")

    _flood(gw.url, 60, 32)
    assert wait_until(lambda: finished(fast) + finished(slow) >= 40, timeout=60, every=0.25)
    f, s = finished(fast), finished(slow)
    assert s >= 1, (f, s)  # both in use
    assert f >= 2 * s, (f, s)  # four times the speed: clearly more of the work
    g = _scrape(gw.url)
    assert _one(g, "qosgate_replica_capacity", replica="r0") <= 2 * BATCH
    assert _one(g, "qosgate_replica_capacity", replica="r1") <= 2 * BATCH
