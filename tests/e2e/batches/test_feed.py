"""Batch jobs run end to end: the official ``openai`` client, real gateway processes, the vLLM
stand-in recording every body it receives. Every custom_id answered exactly once -- through a
``kill -9`` of the gateway and its restart -- cancel and expiry keeping what finished, a line the
tenant's limit refused waiting its turn, a line the engine fails retried, then in the error file.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.batches import (
    answered_lines,
    bodies,
    client,
    completed_so_far,
    config,
    lines_of,
    submit,
    wait_status,
)
from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.ports import reserved_port
from tests.support.processes import Server, start_gateway, start_standin
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Server]:
    """A stand-in recording every body it receives (``--record``); slow enough that a job
    takes seconds (a kill, a cancel and an expiry land mid-job)."""
    s = start_standin(tmp_path, "--record", str(tmp_path / "bodies.jsonl"),
                      "--time-scale", "0.5")
    yield s
    s.stop()


def test_a_200_line_job_answers_every_custom_id_once(standin: Server, tmp_path: Path) -> None:
    gw = start_gateway(tmp_path, "--config", str(config(tmp_path, standin)))
    try:
        c = client(gw)
        bid = submit(c, tmp_path, 200)
        done = wait_status(c, bid, {"completed", "failed"})
        assert done.status == "completed"
        assert done.request_counts.model_dump() == {"total": 200, "completed": 200, "failed": 0}
        out = lines_of(c, done.output_file_id)
        assert sorted(x["custom_id"] for x in out) == sorted(f"req-{i}" for i in range(200))
        assert all(x["response"]["status_code"] == 200 for x in out)
        assert done.error_file_id is None
        seen = bodies(tmp_path)
        assert sum(seen.values()) == 200 and set(seen.values()) == {1}
    finally:
        gw.stop()


def test_kill_9_mid_job_then_restart_loses_and_doubles_nothing(standin: Server,
                                                              tmp_path: Path) -> None:
    """Default batch settings, and another gateway on the host beside it (in front of the same
    engine, with default settings too): killed (-9) mid-job and started again on its address,
    the gateway finishes the job; a line ran at the engine at most twice (once in flight at the
    kill, once after), a line answered before the kill never again, and the other gateway
    neither listed nor ran any of it."""
    cfg = config(tmp_path, standin, own_dir=False)
    state = {"XDG_STATE_HOME": str(tmp_path / "state")}  # one home for every gateway here
    port = reserved_port()  # the restart comes back on it: no bind(0) takes it meanwhile
    gw = start_gateway(tmp_path, "--config", str(cfg), port=port, env=state)
    other = start_gateway(tmp_path, "--config", str(cfg), env=state)
    try:
        c = client(gw)
        bid = submit(c, tmp_path, 200)
        assert wait_until(lambda: 20 <= completed_so_far(c, bid) < 150, timeout=60, every=0.05)
        gw.proc.kill()  # SIGKILL: no shutdown, no last writes
        gw.proc.wait()
        gw.stop()
        before = answered_lines(tmp_path / "state" / "qosgate" / "batches" / f"127.0.0.1-{port}")
        assert 20 <= len(before) < 200
        assert client(other).batches.list().data == []
        gw = start_gateway(tmp_path, "--config", str(cfg), port=port, env=state)
        c = client(gw)
        done = wait_status(c, bid, {"completed", "failed"})
        assert done.status == "completed"
        out = lines_of(c, done.output_file_id)
        ids = Counter(x["custom_id"] for x in out)
        assert ids == Counter(f"req-{i}" for i in range(200))
        seen = bodies(tmp_path)
        assert set(seen) == set(range(200))
        twice = {line for line, n in seen.items() if n > 1}
        assert not twice & before  # no line answered before the kill ran again
        assert max(seen.values()) <= 2
        assert client(other).batches.list().data == []
        assert client(other).files.list().data == []
    finally:
        gw.stop()
        other.stop()


def test_cancel_mid_job_keeps_the_finished_lines(standin: Server, tmp_path: Path) -> None:
    gw = start_gateway(tmp_path, "--config", str(config(tmp_path, standin, capacity=4)))
    try:
        c = client(gw)
        bid = submit(c, tmp_path, 200)
        assert wait_until(lambda: completed_so_far(c, bid) >= 10, timeout=60, every=0.05)
        assert c.batches.cancel(bid).status in ("cancelling", "cancelled")
        done = wait_status(c, bid, {"cancelled"})
        out, err = lines_of(c, done.output_file_id), lines_of(c, done.error_file_id)
        assert len(out) >= 10 and len(out) + len(err) == 200
        assert {x["custom_id"] for x in out}.isdisjoint(x["custom_id"] for x in err)
        assert all(x["response"]["status_code"] == 200 for x in out)
        assert {x["error"]["code"] for x in err} == {"batch_cancelled"}
        assert done.request_counts.completed == len(out)
        assert set(bodies(tmp_path).values()) == {1}
    finally:
        gw.stop()


def test_a_job_past_its_window_ends_expired_keeping_the_finished(standin: Server,
                                                                 tmp_path: Path) -> None:
    gw = start_gateway(tmp_path, "--config", str(config(tmp_path, standin, capacity=2)))
    try:
        c = client(gw)
        bid = submit(c, tmp_path, 200, window="3s", max_tokens=32)
        done = wait_status(c, bid, {"expired", "completed"})
        assert done.status == "expired"
        out, err = lines_of(c, done.output_file_id), lines_of(c, done.error_file_id)
        assert len(out) >= 1 and len(out) + len(err) == 200
        assert {x["error"]["code"] for x in err} == {"batch_expired"}
        assert all(x["response"]["status_code"] == 200 for x in out)
    finally:
        gw.stop()


def test_lines_the_tenant_limit_refuses_wait_and_succeed(standin: Server,
                                                          tmp_path: Path) -> None:
    gw = start_gateway(tmp_path, "--config", str(config(tmp_path, standin)))
    try:
        c = client(gw, "sk-pair")  # at most 2 requests at once: the rest are refused (429)
        bid = submit(c, tmp_path, 12, max_tokens=4)
        done = wait_status(c, bid, {"completed", "failed"})
        assert done.request_counts.model_dump() == {"total": 12, "completed": 12, "failed": 0}
        _, _, text = http("GET", gw.url + "/metrics")
        refused = metric_values(text.decode(), "qosgate_requests_total")
        assert sum(v for k, v in refused.items()
                   if ("reason", "concurrency_limit") in k and ("tenant", "pair") in k) > 0
        assert set(bodies(tmp_path).values()) == {1}
    finally:
        gw.stop()


def test_a_line_the_engine_fails_is_retried_then_in_the_error_file(standin: Server,
                                                                   tmp_path: Path) -> None:
    # no ejection of the failing replica: its lines would wait for it in the queue
    cfg = config(tmp_path, standin, "fleet: {outlier: {enabled: false}}")
    gw = start_gateway(tmp_path, "--config", str(cfg))
    try:
        status, _, _ = http("POST", standin.url + "/admin/fault",
                            json.dumps({"fault": "500"}).encode(),
                            {"Content-Type": "application/json"})
        assert status == 200
        c = client(gw)
        bid = submit(c, tmp_path, 3)
        done = wait_status(c, bid, {"completed", "failed"})
        assert done.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}
        err = lines_of(c, done.error_file_id)
        assert sorted(x["custom_id"] for x in err) == ["req-0", "req-1", "req-2"]
        assert {x["response"]["status_code"] for x in err} == {502}
        seen = bodies(tmp_path)
        assert all(n >= 3 for n in seen.values())  # the first try and 2 retries at least
    finally:
        http("DELETE", standin.url + "/admin/fault")
        gw.stop()
