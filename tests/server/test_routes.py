"""The route table (``server/routes.py``): the HTTP reference's table is the code's, an unknown
route's 404 lists the routes served, and the routes passed through to an engine are refused by
the built-in engine, with a key where the table says so. (Through a real engine: the stand-in in
``tests/e2e/test_passthrough.py``, vLLM in ``tests/e2e/vllm/test_fidelity.py``.)"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from qosgate.server.routes import PASSED, ROUTES, routes_table, served
from tests.support.files import ROOT
from tests.support.inprocess import InProcessGateway

CONFIG = """
tenants:
  - name: acme
    api_keys: [sk-acme]
"""


@pytest.fixture(scope="module")
def gateway() -> Iterator[InProcessGateway]:
    with InProcessGateway(CONFIG) as gw:
        yield gw


def test_the_http_reference_carries_the_route_table_of_the_code() -> None:
    doc = (ROOT / "docs" / "reference" / "http-api.md").read_text()
    assert routes_table() in doc, "docs/reference/http-api.md: paste routes_table() again"


def test_an_unknown_route_is_a_404_that_lists_the_routes_served(
    gateway: InProcessGateway,
) -> None:
    code, _, out = gateway.http("POST", gateway.url + "/v1/audio/speech", b"{}",
                                {"authorization": "Bearer sk-acme"})
    err = json.loads(out)["error"]
    assert code == 404 and err["code"] == "not_found"
    assert "POST /v1/responses" in err["message"] and "POST /tokenize" in err["message"]
    assert served(True) in err["message"]  # the Batch API is on: its routes too


@pytest.mark.parametrize("path", sorted(PASSED))
def test_a_passed_route_needs_an_upstream_engine_and_its_key(
    gateway: InProcessGateway, path: str
) -> None:
    route = PASSED[path]
    method = route.methods[-1]
    body = b'{"prompt": "hi"}' if method == "POST" else None
    code, _, out = gateway.http(method, gateway.url + path, body)
    err = json.loads(out)["error"]
    if path in ("/version", "/ping"):  # no key needed: what health checkers call
        assert code == 404 and "upstream engines" in err["message"], out
    else:
        assert code == 401 and err["code"] == "invalid_api_key", out
    code, _, out = gateway.http(method, gateway.url + path, body,
                                {"authorization": "Bearer sk-acme"})
    assert code == 404 and "upstream engines" in json.loads(out)["error"]["message"]


def test_another_method_on_a_known_route_is_a_405_naming_the_methods(
    gateway: InProcessGateway,
) -> None:
    for r in ROUTES:
        if r.batches or "{" in r.path:
            continue
        other = "PUT"
        code, headers, _ = gateway.http(other, gateway.url + r.path, b"{}")
        assert code == 405 and headers["allow"] == ", ".join(r.methods), r.path


def test_the_responses_api_is_refused_by_the_built_in_engine_with_the_reason(
    gateway: InProcessGateway,
) -> None:
    body = json.dumps({"input": "hi", "max_output_tokens": 4}).encode()
    code, _, out = gateway.http("POST", gateway.url + "/v1/responses", body,
                                {"authorization": "Bearer sk-acme"})
    err = json.loads(out)["error"]
    assert code == 400 and "Responses API" in err["message"], out
    code, _, out = gateway.http("POST", gateway.url + "/v1/responses", b'{"model": "x"}',
                                {"authorization": "Bearer sk-acme"})
    assert code == 400 and json.loads(out)["error"]["param"] == "input"
