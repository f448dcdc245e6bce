"""A configured LoRA adapter through the gateway in this process: served wherever its base is,
though no engine lists it (``models[].base``), and an adapter nobody configured stays unknown."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.support.inprocess import InProcessGateway
from tests.support.processes import MODEL

CONFIG = f"""
engine: {{served_model_name: {MODEL}}}
models:
  - {{name: {MODEL}}}
  - {{name: ad-x, base: {MODEL}, load_cost: 512}}
"""


@pytest.fixture(scope="module")
def gateway() -> Iterator[InProcessGateway]:
    with InProcessGateway(CONFIG) as gw:
        yield gw


def chat(gw: InProcessGateway, model: str) -> tuple[int, bytes]:
    body = json.dumps({"model": model, "max_tokens": 2,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()
    code, _, answer = gw.http("POST", gw.url + "/v1/chat/completions", body,
                              {"Authorization": "Bearer test",
                               "Content-Type": "application/json"})
    return code, answer


def test_an_adapter_is_served_where_its_base_is(gateway: InProcessGateway) -> None:
    code, answer = chat(gateway, "ad-x")
    assert code == 200, answer


def test_an_adapter_not_configured_is_unknown(gateway: InProcessGateway) -> None:
    code, answer = chat(gateway, "ad-y")
    assert code == 404, answer
    assert b"ad-y" in answer
