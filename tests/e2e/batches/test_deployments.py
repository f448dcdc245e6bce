"""Two gateways on one host are two deployments: with default settings each keeps its own jobs
(the official ``openai`` client, real gateway processes, stand-ins serving different models); a
second gateway started by mistake on another's directory stops at start, saying whose it is;
the workers of one ``serve --workers`` without Redis are one deployment, and one of them runs
each line."""

from __future__ import annotations

import json
import subprocess
import time
from http.client import HTTPConnection
from pathlib import Path

import openai
import pytest

from tests.support.batches import bodies, client, config, lines_of, submit, wait_status
from tests.support.httpclient import http
from tests.support.ports import free_port
from tests.support.processes import Server, gateway_args, start_gateway, start_standin
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e


def gateway_config(tmp: Path, standin: Server) -> Path:
    """Default batch settings (no ``batches.dir``)."""
    path = tmp / f"gw-{time.monotonic_ns()}.yaml"
    path.write_text(f"""
tenants: [{{name: acme, api_keys: [sk-acme]}}]
upstreams: [{{url: {standin.url}, max_window: 8}}]
batches: {{live_span_s: 0.2}}
""")
    return path


def engine_requests(standin: Server) -> list[object]:
    status, _, body = http("GET", standin.url + "/debug/requests")
    assert status == 200
    requests: list[object] = json.loads(body)["requests"]
    return requests


def test_two_gateways_with_default_settings_never_meet(tmp_path: Path) -> None:
    """A in front of an engine serving ``alpha``, B of one serving ``beta``, one user's state
    home: a 60-line job sent to A is A's alone. B neither lists it nor its file, B's engine gets
    no request, and A answers all 60."""
    alpha = start_standin(tmp_path, "--served-model-name", "alpha", "--time-scale", "0.5",
                          "--record", str(tmp_path / "alpha.jsonl"))
    beta = start_standin(tmp_path, "--served-model-name", "beta")
    state = {"XDG_STATE_HOME": str(tmp_path / "state")}
    a = start_gateway(tmp_path, "--config", str(gateway_config(tmp_path, alpha)), env=state)
    b = start_gateway(tmp_path, "--config", str(gateway_config(tmp_path, beta)), env=state)
    try:
        ca, cb = client(a), client(b)
        bid = submit(ca, tmp_path, 60, model="alpha")
        fid = ca.batches.retrieve(bid).input_file_id
        assert wait_until(lambda: ca.batches.retrieve(bid).status == "in_progress", timeout=30)
        assert cb.batches.list().data == [] and cb.files.list().data == []
        with pytest.raises(openai.NotFoundError):
            cb.batches.retrieve(bid)
        with pytest.raises(openai.NotFoundError):
            cb.files.retrieve(fid)
        done = wait_status(ca, bid, {"completed", "failed", "expired", "cancelled"})
        assert done.request_counts.model_dump() == {"total": 60, "completed": 60, "failed": 0}
        assert len(lines_of(ca, done.output_file_id)) == 60 and done.error_file_id is None
        assert cb.batches.list().data == [] and cb.files.list().data == []
        assert engine_requests(beta) == []
        assert bodies(tmp_path, "alpha.jsonl") == {i: 1 for i in range(60)}
        homes = tmp_path / "state" / "qosgate" / "batches"
        assert sorted(p.name for p in homes.iterdir()) == sorted(
            f"127.0.0.1-{gw.port}" for gw in (a, b))
    finally:
        for s in (a, b, alpha, beta):
            s.stop()


def test_a_second_gateway_on_the_same_directory_stops_at_start(tmp_path: Path) -> None:
    standin = start_standin(tmp_path)
    cfg = config(tmp_path, standin)  # batches.dir: tmp/batches, no Redis
    first = start_gateway(tmp_path, "--config", str(cfg))
    try:
        port = free_port()
        r = subprocess.run(gateway_args(port, "--config", str(cfg)), capture_output=True,
                           text=True, timeout=60, check=False)
        assert first.proc.poll() is None
    finally:
        first.stop()
        standin.stop()
    assert r.returncode == 2, r.stdout + r.stderr
    err = " ".join(r.stderr.split())  # the console wraps long lines
    for part in ("cannot keep batch jobs", str(tmp_path / "batches"), f"pid {first.proc.pid}",
                 f"127.0.0.1:{first.port}", "its own batches.dir", "the same redis.url"):
        assert part in err, err
    assert "serving on" not in r.stdout


def test_workers_without_redis_are_one_deployment_and_run_each_line_once(
        tmp_path: Path) -> None:
    """``serve --workers 2``, no Redis: both workers list the job (new connections reach either),
    worker 0 alone runs it, every line once (the job lasts several of the feeders' sweeps: two
    feeders alone on one directory would take it from each other at each)."""
    standin = start_standin(tmp_path, "--record", str(tmp_path / "bodies.jsonl"),
                            "--time-scale", "2")
    gw = start_gateway(tmp_path, "--config", str(gateway_config(tmp_path, standin)),
                       "--workers", "2", "--instance-id", "wk")
    try:
        bid = submit(client(gw), tmp_path, 200)
        listed_by: set[str] = set()

        def both_list_it() -> bool:
            # a new connection each time (the kernel spreads them), two requests on it: the
            # worker that lists the job, and its instance id
            conn = HTTPConnection("127.0.0.1", gw.port, timeout=10)
            try:
                auth = {"Authorization": "Bearer sk-acme"}
                conn.request("GET", "/v1/batches", headers=auth)
                page = json.loads(conn.getresponse().read())
                conn.request("GET", "/v1/qos/status", headers=auth)
                instance = json.loads(conn.getresponse().read())["instance"]
            finally:
                conn.close()
            if bid in {j["id"] for j in page["data"]}:
                listed_by.add(instance)
            return listed_by == {"wk-w0", "wk-w1"}

        assert wait_until(both_list_it, timeout=30), listed_by
        done = wait_status(client(gw), bid, {"completed", "failed", "expired", "cancelled"})
        assert done.request_counts.model_dump() == {"total": 200, "completed": 200, "failed": 0}
        assert bodies(tmp_path) == {i: 1 for i in range(200)}
    finally:
        assert gw.stop() == 0
        standin.stop()
