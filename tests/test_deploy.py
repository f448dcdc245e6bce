"""``deploy/``'s Containerfile, Kubernetes manifests and systemd unit against the application: no
Docker, kubectl or systemd here, so each file is read, its flags go through ``qosgate serve``'s
own parser, and its ports and probes are cross-checked. (Real gateways started with its flags
and variables, addresses made local, to answer every probe it declares:
``tests/e2e/test_deploy.py``.)"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from qosgate.config import load_config
from qosgate.settings import check_settings, load_settings
from tests.support.deploy_files import (
    CONFIG,
    FLAVOURS,
    container_deployed,
    containerfile,
    k8s_container,
    k8s_deployed,
    kind,
    manifests,
    options,
    parse,
    serve_envvars,
    unit_value,
)


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


