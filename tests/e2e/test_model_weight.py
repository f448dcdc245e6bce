"""A model weight learned from the engines themselves: a real gateway in front of two stand-ins,
one serving a light model and one a heavy model whose every engine step takes ten times as long
(``--slow 10``), learns the heavy model's weight (``weight: auto``) from each engine's
``vllm:inter_token_latency_seconds`` in its ``/metrics``, and charges the tenant on it by that
weight. Every wait is on a condition, bounded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from openai import OpenAI

from tests.support.httpclient import http
from tests.support.processes import Server, start_gateway, start_standin
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("model_weight")
    light = start_standin(tmp, "--served-model-name", "light", "--time-scale", "1")
    heavy = start_standin(tmp, "--served-model-name", "heavy", "--time-scale", "1",
                          "--slow", "10")
    cfg = {
        "upstreams": [{"url": light.url, "name": "light-0", "models": ["light"]},
                      {"url": heavy.url, "name": "heavy-0", "models": ["heavy"]}],
        "tenants": [{"name": "acme", "api_keys": ["sk-acme"]}],
        "fairness": {"reference_model": "light"},
        "models": [{"name": "light"}, {"name": "heavy", "weight": "auto"}],
    }
    path = tmp / "gateway.json"
    path.write_text(json.dumps(cfg))
    gw = start_gateway(tmp, "--config", str(path))
    try:
        yield gw
    finally:
        gw.stop()
        light.stop()
        heavy.stop()


def _status(gw: Server) -> dict[str, Any]:
    _, _, body = http("GET", gw.url + "/v1/qos/status",
                      headers={"authorization": "Bearer sk-acme"})
    return dict(json.loads(body))


def test_the_heavy_models_weight_is_learned_from_its_engine(gateway: Server) -> None:
    client = OpenAI(base_url=gateway.url + "/v1", api_key="sk-acme", max_retries=0, timeout=60)

    def one_each() -> bool:
        for model in ("light", "heavy"):
            client.completions.create(model=model, prompt="hello there", max_tokens=16)
        w = _status(gateway)["models"]["heavy"]
        return bool(w["source"] == "learned")

    # each round sends one request per model, so every scrape sees one sequence running;
    # learning needs two scrapes of each engine with tokens decoded between them
    assert wait_until(one_each, 60, every=0.2)
    w = _status(gateway)["models"]["heavy"]
    print(f"\nheavy model's weight learned from the engines: prompt {w['prompt']:.2f}, "
          f"output {w['output']:.2f} ({w['source']})")
    # one sequence alone on each engine: the heavy engine's steps are ten times as long
    assert w["output"] == pytest.approx(10.0, rel=0.15)
    assert w["prompt"] == pytest.approx(w["output"])

    # what the tenant is charged for each model follows the weight
    before = _status(gateway)["tenants"]["acme"]["models"]
    client.completions.create(model="heavy", prompt="hello there", max_tokens=16)
    client.completions.create(model="light", prompt="hello there", max_tokens=16)
    after = _status(gateway)["tenants"]["acme"]["models"]
    weight = _status(gateway)["models"]["heavy"]["output"]

    def added(model: str, key: str) -> float:
        return float(after[model][key] - before[model][key])

    ref_cost = added("light", "prompt_tokens") + 2 * added("light", "output_tokens")
    assert added("light", "charged") == pytest.approx(ref_cost)
    heavy_tokens = added("heavy", "prompt_tokens") + 2 * added("heavy", "output_tokens")
    assert added("heavy", "charged") == pytest.approx(weight * heavy_tokens, rel=0.02)
