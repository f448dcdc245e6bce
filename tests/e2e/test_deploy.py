"""``deploy/``'s Containerfile, Kubernetes manifests and systemd unit, run: real gateways are
started with each file's flags and variables (addresses made local) and answer every probe it
declares. (The files read and cross-checked: ``tests/test_deploy.py``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.deploy_files import (
    CONFIG,
    STATE_ENV,
    Deployed,
    container_deployed,
    containerfile,
    k8s_container,
    k8s_deployed,
    options,
    parse,
    systemd_deployed,
)
from tests.support.httpclient import http
from tests.support.ports import free_port
from tests.support.processes import QOSGATE, Server, start_standin
from tests.support.waiting import wait_until


# ---------------------------------------------------------------- real gateways
@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_standin(tmp_path_factory.mktemp("standin"))
    yield s
    s.stop()


@dataclass
class Local:
    server: Server
    ports: dict[int, int]  # the file's port -> the local one


def start_local(d: Deployed, tmp: Path, standin: Server, monkeypatch: pytest.MonkeyPatch,
                redis_url: str | None = None, extra_env: dict[str, str] | None = None) -> Local:
    """The gateway ``d`` describes, with its addresses made local: free ports, the stand-in as
    the upstream, the example config from deploy/, ``redis_url`` (or none) as Redis."""
    params = parse(d.argv, d.env, monkeypatch)
    ports = {params["port"]: free_port(), params["metrics_port"]: free_port()}
    local_value = {
        "--upstream": standin.url, "-u": standin.url, "--config": str(CONFIG),
        "-c": str(CONFIG), "--host": "127.0.0.1", "--redis": redis_url,
        "--port": str(ports[params["port"]]), "--metrics-port": str(ports[params["metrics_port"]]),
    }
    argv: list[str] = []
    for flag, val in options(d.argv):
        if flag in local_value:
            val = local_value[flag]
            if val is None:
                continue
        argv += [flag] if val is None else [f"{flag}={val}"]
    env = dict(d.env, **(extra_env or {}))
    env.update({k: v for k, v in {
        STATE_ENV: str(tmp / "state"),
        "QOSGATE_HOST": "127.0.0.1", "QOSGATE_CONFIG": str(CONFIG),
        "QOSGATE_UPSTREAM": standin.url, "QOSGATE_PORT": str(ports[params["port"]]),
        "QOSGATE_METRICS_PORT": str(ports[params["metrics_port"]]),
    }.items() if k in env})
    if "QOSGATE_REDIS" in env:
        if redis_url is None:
            del env["QOSGATE_REDIS"]
        else:
            env["QOSGATE_REDIS"] = redis_url
    with monkeypatch.context() as m:
        for k in [k for k in os.environ if k.startswith("QOSGATE_")]:
            m.delenv(k)
        for k, v in env.items():
            m.setenv(k, v)
        port = ports[params["port"]]
        server = Server([*QOSGATE, "serve", "--log-level", "warning", *argv], port, "/readyz",
                        tmp / f"gateway-{port}.log")
    return Local(server, ports)


@pytest.mark.e2e
def test_container_healthcheck_passes_on_a_running_gateway(
        standin: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # as `docker run -e QOSGATE_UPSTREAM=...` (deploy/README.md)
    local = start_local(container_deployed(), tmp_path, standin, monkeypatch,
                        extra_env={"QOSGATE_UPSTREAM": standin.url})
    try:
        (check,) = containerfile()["HEALTHCHECK"]
        argv = json.loads(check.split("CMD", 1)[1])
        for theirs, ours in local.ports.items():
            argv = [a.replace(f"127.0.0.1:{theirs}/", f"127.0.0.1:{ours}/") for a in argv]
        assert argv[0] == "python"
        r = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True,
                           timeout=30, check=False)
        assert r.returncode == 0, r.stderr
    finally:
        assert local.server.stop() == 0


@pytest.mark.e2e
def test_kubernetes_replicas_answer_their_probes_and_share_redis(
        standin: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support.redis_server import RedisServer

    redis = RedisServer(tmp_path)
    c = k8s_container()
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    started: list[Local] = []
    try:
        for pod in ("qosgate-a", "qosgate-b"):  # what the fieldRef / secretKeyRef would give
            started.append(start_local(
                k8s_deployed(), tmp_path, standin, monkeypatch, redis.url,
                {"QOSGATE_INSTANCE_ID": pod, "QOSGATE_ADMIN_KEY": "sk-admin-test"}))
        for local in started:
            for probe in ("livenessProbe", "readinessProbe"):
                get = c[probe]["httpGet"]
                port = local.ports[named.get(get["port"], get["port"])]
                code = http("GET", f"http://127.0.0.1:{port}{get['path']}")[0]
                assert code == 200, (probe, get)
        admin = {"Authorization": "Bearer sk-admin-test"}

        def both_live() -> bool:
            st = json.loads(http("GET", started[0].server.url + "/v1/qos/status",
                                 headers=admin)[2])
            return bool(st["shared_state"].get("live_instances") == 2)

        assert wait_until(both_live, timeout=20)
    finally:
        for local in started:
            assert local.server.stop() == 0
        redis.stop()


@pytest.mark.e2e
def test_systemd_unit_starts_a_ready_gateway(standin: Server, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    local = start_local(systemd_deployed(), tmp_path, standin, monkeypatch)
    try:
        for path in ("/health", "/readyz"):
            assert http("GET", local.server.url + path)[0] == 200
    finally:
        assert local.server.stop() == 0
