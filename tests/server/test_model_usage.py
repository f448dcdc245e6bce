"""Each tenant's use of each model, in tokens and in the charged unit (reference-model tokens),
as the status, the metrics and ``qosgate top`` show it, from one in-process gateway whose
built-in engine serves a model four times as heavy as the reference."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator

import pytest
from rich.console import Console

from qosgate.top.view import Scrape, frame, parse_metrics
from tests.support.inprocess import InProcessGateway

CONFIG = """
tenants:
  - {name: acme, api_keys: [sk-acme]}
  - {name: umbrella, api_keys: [sk-umbrella]}
fairness: {reference_model: small}
models:
  - {name: small}
  - {name: qosgate-sim, weight: 4}
"""


@pytest.fixture(scope="module")
def gateway() -> Iterator[InProcessGateway]:
    with InProcessGateway(CONFIG) as gw:
        out = gw.client("sk-acme").completions.create(model="qosgate-sim", prompt="abc",
                                                      max_tokens=3)
        assert out.usage is not None
        yield gw


def _status(gw: InProcessGateway, key: str) -> dict[str, object]:
    code, _, body = gw.http("GET", gw.url + "/v1/qos/status",
                            headers={"authorization": f"Bearer {key}"})
    assert code == 200
    return dict(json.loads(body))


def test_status_shows_each_tenants_use_per_model_and_the_weights(
        gateway: InProcessGateway) -> None:
    view = _status(gateway, "sk-acme")
    used = view["tenants"]["acme"]["models"]["qosgate-sim"]
    assert used["requests"] == 1
    prompt, output = used["prompt_tokens"], used["output_tokens"]
    assert prompt > 0 and output == 3
    # fairness weights 1 (prompt) and 2 (output), times the model's weight 4
    assert used["charged"] == pytest.approx(4 * (prompt + 2 * output))
    assert view["charged_unit"] == "reference-model tokens"
    assert view["models"]["qosgate-sim"] == {
        "prompt": 4.0, "output": 4.0, "source": "configured"}
    # another tenant's key sees none of acme's use
    other = _status(gateway, "sk-umbrella")
    assert "acme" not in other["tenants"]


def test_metrics_and_top_show_the_same_use(gateway: InProcessGateway) -> None:
    used = _status(gateway, "sk-acme")["tenants"]["acme"]["models"]["qosgate-sim"]
    code, _, body = gateway.http("GET", gateway.url + "/metrics")
    assert code == 200
    samples = parse_metrics(body.decode())
    tokens = {(lab["tenant"], lab["model"], lab["kind"]): v
              for lab, v in samples["qosgate_tenant_model_tokens_total"]}
    assert tokens[("acme", "qosgate-sim", "prompt")] == used["prompt_tokens"]
    assert tokens[("acme", "qosgate-sim", "output")] == used["output_tokens"]
    charged = {(lab["tenant"], lab["model"]): v
               for lab, v in samples["qosgate_tenant_model_charged_total"]}
    assert charged[("acme", "qosgate-sim")] == pytest.approx(used["charged"])
    weights = {(lab["model"], lab["kind"]): v for lab, v in samples["qosgate_model_weight"]}
    assert weights[("qosgate-sim", "output")] == 4.0
    console = Console(width=140, file=io.StringIO(), color_system=None, record=True)
    console.print(frame([Scrape(gateway.url, time.monotonic(), status=None, metrics=samples)]))
    shown = console.export_text()
    assert "models per tenant" in shown
    row = next(line for line in shown.splitlines() if "qosgate-sim" in line and "acme" in line)
    assert row.split()[-3:] == [str(used["prompt_tokens"]), str(used["output_tokens"]),
                                f"{used['charged']:.0f}"]
