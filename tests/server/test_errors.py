"""Errors that say what is wrong, from the gateway in this process (the simulated engine serving
the stand-in's model name): an ``Authorization`` header without ``Bearer``, a tenant's rate
limit, a known path asked with the wrong method, an unknown path. (An unknown class, on every
route the stand-in serves: ``tests/e2e/test_errors.py``.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.support.inprocess import InProcessGateway
from tests.support.processes import MODEL

CONFIG = """
tenants:
  - name: acme
    api_keys: [sk-acme]
  - name: limited
    api_keys: [sk-limited-1, sk-limited-2]
    limits: {requests_per_minute: 1}
engine: {served_model_name: MODEL}
""".replace("MODEL", MODEL)


@pytest.fixture(scope="module")
def gateway() -> Iterator[InProcessGateway]:
    with InProcessGateway(CONFIG) as gw:
        yield gw


def client(gw: InProcessGateway, key: str = "sk-acme") -> OpenAI:
    return gw.client(key)


def openai_error(body: bytes) -> dict[str, Any]:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


CHAT = json.dumps({"model": MODEL, "max_tokens": 1,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_authorization_without_bearer_says_so(gateway: InProcessGateway) -> None:
    for value in ("sk-acme", "Token sk-acme", "Bearer "):
        for method, path, body in (("POST", "/v1/chat/completions", CHAT),
                                   ("GET", "/v1/models", None)):
            code, _, out = gateway.http(method, gateway.url + path, body, {"Authorization": value})
            err = openai_error(out)
            assert code == 401 and err["code"] == "invalid_api_key", (value, path, out)
            assert "must be 'Bearer <key>'" in err["message"], (value, path, err)
    code, _, out = gateway.http("POST", gateway.url + "/v1/chat/completions", CHAT)
    assert code == 401 and openai_error(out)["message"] == "Missing API key."


def test_a_tenant_rate_limit_is_named_as_the_tenant_s(gateway: InProcessGateway) -> None:
    msgs: Any = [{"role": "user", "content": "hi"}]
    client(gateway, "sk-limited-1").chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as exc:  # the other key: the same tenant's limit
        client(gateway, "sk-limited-2").chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=1)
    assert exc.value.code == "rate_limit_requests"
    message = exc.value.message
    assert "this key" not in message
    assert "Tenant 'limited'" in message and "limits.requests_per_minute" in message
    assert "shared by all its API keys" in message


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("GET", "/v1/completions", "POST"),
        ("PUT", "/v1/embeddings", "POST"),
        ("POST", "/v1/models", "GET, HEAD"),
        ("DELETE", "/v1/qos/status", "GET, HEAD"),
        ("POST", "/readyz", "GET, HEAD"),
    ],
)
def test_a_known_path_with_the_wrong_method_is_405(
    gateway: InProcessGateway, method: str, path: str, allow: str
) -> None:
    code, headers, out = gateway.http(method, gateway.url + path,
                                      b"{}" if method != "GET" else None,
                                      {"Authorization": "Bearer sk-acme"})
    assert code == 405, out
    assert headers["allow"] == allow
    err = openai_error(out)
    assert err["code"] == "method_not_allowed" and err["type"] == "invalid_request_error"
    assert method in err["message"] and allow in err["message"]


def test_unknown_paths_stay_404(gateway: InProcessGateway) -> None:
    for method in ("GET", "POST"):
        code, _, out = gateway.http(method, gateway.url + "/v1/nope",
                                    b"{}" if method == "POST" else None)
        assert code == 404 and openai_error(out)["code"] == "not_found"
