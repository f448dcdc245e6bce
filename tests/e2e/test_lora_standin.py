"""LoRA adapters on a fleet of two stand-ins behind the gateway (the same scenario as
``tests/e2e/vllm/test_lora.py`` on real vLLM, here in seconds): each stand-in holds one adapter at
a time (``--max-loras 1``); with a load cost configured, each adapter's requests stay on one
replica, the two adapters on different ones, and each engine's own metric names only its adapter.
Without a load cost the router has no reason to keep them apart: on an idle fleet every request
goes to the first replica, which swaps adapters on every request."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from qosgate.wire.lora_info import loaded_adapters
from tests.support.httpclient import http
from tests.support.lora import ADAPTERS, Served, gateway_config, serve_in_turn
from tests.support.processes import MODEL, Server, start_gateway, start_standin

pytestmark = pytest.mark.e2e

ROUNDS = 4


def _standins(tmp: Path) -> dict[str, Server]:
    modules = [f"{a}=/adapters/{a}" for a in ADAPTERS]
    return {name: start_standin(tmp, "--served-model-name", MODEL, "--time-scale", "0.02",
                                "--enable-lora", "--max-loras", "1", "--lora-load-ms", "200",
                                "--lora-modules", *modules)
            for name in ("a", "b")}


def _run(tmp: Path, load_cost: float) -> tuple[Served, dict[str, tuple[str, ...] | None]]:
    engines = _standins(tmp)
    log = tmp / f"requests-{load_cost}.jsonl"
    cfg = tmp / f"gateway-{load_cost}.yaml"
    cfg.write_text(gateway_config(MODEL, {n: s.url for n, s in engines.items()}, log, load_cost))
    gw = start_gateway(tmp, "--config", str(cfg))
    try:
        served = serve_in_turn(gw.url, log, ADAPTERS, ROUNDS)
        held: dict[str, tuple[str, ...] | None] = {}
        for name, engine in engines.items():
            found = loaded_adapters(http("GET", engine.url + "/metrics")[2].decode())
            held[name] = found.loaded if found is not None else None
        return served, held
    finally:
        gw.stop()
        for s in engines.values():
            s.stop()


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield tmp_path_factory.mktemp("lora")


def test_each_adapter_stays_on_the_replica_that_holds_it(tmp: Path) -> None:
    served, held = _run(tmp, 4096)
    alpha, beta = (served.replicas[a] for a in ADAPTERS)
    assert len(set(alpha)) == 1 and len(set(beta)) == 1, served.replicas
    assert alpha[0] != beta[0], served.replicas
    assert held == {alpha[0]: ("alpha",), beta[0]: ("beta",)}


def test_without_a_load_cost_one_replica_swaps_adapters(tmp: Path) -> None:
    served, _ = _run(tmp, 0)
    assert set(served.replicas["alpha"]) == set(served.replicas["beta"]), served.replicas
