"""``deploy/``'s Containerfile, Kubernetes manifests and systemd unit against the application: no
Docker, kubectl or systemd here, so each file is read, its flags go through ``qosgate serve``'s
own parser, its ports and probes are cross-checked, and real gateways are started with its flags
and variables (addresses made local) to answer every probe it declares."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import typer
import yaml

from qosgate.cli import app
from qosgate.config import load_config
from qosgate.settings import check_settings, load_settings
from tests.support.httpclient import http
from tests.support.ports import free_port
from tests.support.processes import QOSGATE, Server, start_standin
from tests.support.waiting import wait_until

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
CONFIG = DEPLOY / "qosgate.yaml"


# ---------------------------------------------------------------- qosgate serve, introspected
def serve_command() -> Any:
    return typer.main.get_command(app).commands["serve"]  # type: ignore[attr-defined]


# read by serve beyond its options: where batch jobs live by default (runtime/batches/directory)
STATE_ENV = "XDG_STATE_HOME"


def serve_envvars() -> set[str]:
    return {p.envvar for p in serve_command().params if isinstance(p.envvar, str)} | {STATE_ENV}


def options(argv: list[str]) -> list[tuple[str, str | None]]:
    """``argv`` as (flag, value) pairs, by what serve declares: a value for options, none for
    on/off flags. An unknown flag fails here."""
    takes_value = {}
    for p in serve_command().params:
        for name in (*p.opts, *p.secondary_opts):
            takes_value[name] = not getattr(p, "is_flag", False)
    out: list[tuple[str, str | None]] = []
    it = iter(argv)
    for tok in it:
        flag, eq, val = tok.partition("=")
        assert flag in takes_value, f"{flag}: not an option of `qosgate serve`"
        if takes_value[flag]:
            out.append((flag, val if eq else next(it)))
        else:
            assert not eq, tok
            out.append((flag, None))
    return out


def parse(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
          ) -> dict[str, Any]:
    """What ``qosgate serve`` makes of these flags and variables: its own parser (types,
    choices, precedence), without running it."""
    unknown = set(env) - serve_envvars()
    assert not unknown, f"not read by `qosgate serve`: {unknown}"
    with monkeypatch.context() as m:
        for k in [k for k in os.environ if k.startswith("QOSGATE_")]:
            m.delenv(k)
        for k, v in env.items():
            m.setenv(k, v)
        ctx = serve_command().make_context("serve", list(argv))
    params: dict[str, Any] = ctx.params
    return params


@dataclass
class Deployed:
    """One file's way of running ``qosgate serve``."""

    argv: list[str]
    env: dict[str, str]  # literal values
    env_from: set[str]  # set at run time (Kubernetes fieldRef / secretKeyRef)


# ---------------------------------------------------------------- the files, read
def containerfile() -> dict[str, list[str]]:
    """Instruction -> its arguments, one entry per occurrence (continuations joined)."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Containerfile").read_text())
    out: dict[str, list[str]] = {}
    for ln in text.splitlines():
        ln = ln.strip()
        if ln and not ln.startswith("#"):
            word, _, rest = ln.partition(" ")
            out.setdefault(word.upper(), []).append(rest.strip())
    return out


def container_deployed() -> Deployed:
    cf = containerfile()
    env = dict(kv.split("=", 1) for line in cf["ENV"] for kv in shlex.split(line))
    entry, cmd = json.loads(cf["ENTRYPOINT"][-1]), json.loads(cf["CMD"][-1])
    assert entry == ["qosgate", "serve"]
    return Deployed(cmd, {k: v for k, v in env.items() if k.startswith("QOSGATE_")}, set())


def manifests(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / "kubernetes" / name).read_text()) if d]


def kind(docs: list[dict[str, Any]], k: str, name: str) -> dict[str, Any]:
    return next(d for d in docs if d["kind"] == k and d["metadata"]["name"] == name)


def k8s_container() -> dict[str, Any]:
    dep = kind(manifests("deployment.yaml"), "Deployment", "qosgate")
    c: dict[str, Any] = dep["spec"]["template"]["spec"]["containers"][0]
    return c


def k8s_deployed() -> Deployed:
    c = k8s_container()
    env = {e["name"]: str(e["value"]) for e in c.get("env", []) if "value" in e}
    return Deployed(list(c.get("args", [])), env,
                    {e["name"] for e in c.get("env", []) if "valueFrom" in e})


def unit() -> dict[str, list[tuple[str, str]]]:
    """Section -> (key, value) in order (systemd repeats keys such as Environment=)."""
    out: dict[str, list[tuple[str, str]]] = {}
    section = ""
    for ln in (DEPLOY / "systemd" / "qosgate.service").read_text().splitlines():
        ln = ln.strip()
        if not ln or ln.startswith(("#", ";")):
            continue
        if ln.startswith("["):
            section = ln.strip("[]")
            continue
        k, _, v = ln.partition("=")
        out.setdefault(section, []).append((k.strip(), v.strip()))
    return out


def unit_value(key: str) -> str:
    return next(v for k, v in unit()["Service"] if k == key)


def systemd_deployed() -> Deployed:
    env = dict(shlex.split(v)[0].split("=", 1) for k, v in unit()["Service"]
               if k == "Environment")
    exe, sub, *argv = shlex.split(unit_value("ExecStart"))
    assert exe.endswith("/qosgate") and sub == "serve"
    return Deployed(argv, env, set())


FLAVOURS = {"container": container_deployed, "kubernetes": k8s_deployed,
            "systemd": systemd_deployed}


# ---------------------------------------------------------------- static checks
@pytest.mark.parametrize("flavour", FLAVOURS)
def test_flags_and_variables_are_serves_own(flavour: str, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    d = FLAVOURS[flavour]()
    options(d.argv)  # every flag declared by serve
    assert not d.env_from - serve_envvars(), d.env_from - serve_envvars()
    params = parse(d.argv, d.env, monkeypatch)
    # the same ports everywhere (deploy/README.md), on every interface
    assert (params["port"], params["metrics_port"]) == (8000, 8090)
    assert params["host"] == "0.0.0.0"
    if flavour != "container":  # the image leaves the engine and the config to `docker run`
        assert params["upstream"], "the examples front an engine"
        assert params["config"] == Path("/etc/qosgate/qosgate.yaml")
        assert params["upstream_polarity"] == "vllm"


def test_example_config_is_valid_and_the_configmap_is_it() -> None:
    cfg, settings = load_config(CONFIG), load_settings(CONFIG)
    assert check_settings(cfg, settings) == []
    assert cfg.tenants and not settings.upstreams  # the engine comes from --upstream
    cm = kind(manifests("configmap.yaml"), "ConfigMap", "qosgate-config")
    assert cm["data"]["qosgate.yaml"] == CONFIG.read_text()


def test_containerfile(monkeypatch: pytest.MonkeyPatch) -> None:
    cf = containerfile()
    assert re.fullmatch(r"python:3\.1[1-9]-slim", cf["FROM"][0]), cf["FROM"]
    installs = [r for r in cf["RUN"] if "pip install" in r]
    assert installs and not any("embedded" in r for r in installs)
    user = cf["USER"][-1].split(":")[0]
    assert user not in ("root", "0")
    d = container_deployed()
    params = parse(d.argv, d.env, monkeypatch)
    assert {int(p) for line in cf["EXPOSE"] for p in line.split()} == {
        params["port"], params["metrics_port"]}
    (check,) = cf["HEALTHCHECK"]
    argv = json.loads(check.split("CMD", 1)[1])
    url = urlsplit(re.findall(r"http://[^'\" ]+", " ".join(argv))[0])
    assert url.path == "/health" and url.port in (params["port"], params["metrics_port"])


def test_kubernetes_ports_probes_redis_and_config(monkeypatch: pytest.MonkeyPatch) -> None:
    d = k8s_deployed()
    params = parse(d.argv, d.env, monkeypatch)
    c = k8s_container()
    named = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert named == {"http": params["port"], "metrics": params["metrics_port"]}
    for probe, path in (("livenessProbe", "/health"), ("readinessProbe", "/readyz")):
        get = c[probe]["httpGet"]
        assert get["path"] == path and get["port"] in named
    pod = kind(manifests("deployment.yaml"), "Deployment", "qosgate")["spec"]["template"]
    notes = pod["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true" and notes["prometheus.io/path"] == "/metrics"
    assert int(notes["prometheus.io/port"]) == named["metrics"]
    svc = kind(manifests("deployment.yaml"), "Service", "qosgate")
    assert svc["spec"]["selector"] == pod["metadata"]["labels"]
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == set(named)
    # the replicas share Redis: the URL names redis.yaml's Service and port
    dep = kind(manifests("deployment.yaml"), "Deployment", "qosgate")
    assert dep["spec"]["replicas"] > 1
    url = urlsplit(params["redis"])
    rsvc = kind(manifests("redis.yaml"), "Service", url.hostname or "")
    assert url.port in [p["port"] for p in rsvc["spec"]["ports"]]
    rdep = kind(manifests("redis.yaml"), "Deployment", url.hostname or "")
    assert rsvc["spec"]["selector"] == rdep["spec"]["template"]["metadata"]["labels"]
    # the config: mounted where QOSGATE_CONFIG points, from the ConfigMap that holds it
    cfg = Path(d.env["QOSGATE_CONFIG"])
    mount = next(m for m in c["volumeMounts"] if Path(m["mountPath"]) == cfg.parent)
    vol = next(v for v in pod["spec"]["volumes"] if v["name"] == mount["name"])
    cm = kind(manifests("configmap.yaml"), "ConfigMap", vol["configMap"]["name"])
    assert cfg.name in cm["data"]
    grace = pod["spec"]["terminationGracePeriodSeconds"]
    assert grace > load_settings(CONFIG).server.shutdown_timeout_s


def test_systemd_unit_stops_after_the_drain() -> None:
    assert float(unit_value("TimeoutStopSec")) > load_settings(CONFIG).server.shutdown_timeout_s
    assert unit_value("User") not in ("root", "0")
    assert "2" in unit_value("RestartPreventExitStatus").split()


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
