"""Errors that say what is wrong, end to end through a gateway in front of the vLLM stand-in:
an ``Authorization`` header without ``Bearer``, an unknown class named in the body or in the
header, a tenant's rate limit, and a known path asked with the wrong method."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.support.httpclient import http
from tests.support.processes import MODEL, Server, gateway_from

pytestmark = pytest.mark.e2e

CONFIG = """
tenants:
  - name: acme
    api_keys: [sk-acme]
  - name: limited
    api_keys: [sk-limited-1, sk-limited-2]
    limits: {requests_per_minute: 1}
upstreams:
  - url: {URL}
    name: standin
"""


@pytest.fixture(scope="module")
def gateway(standin: Server, tmp_session: Path) -> Iterator[Server]:
    yield from gateway_from(tmp_session, "errors.yaml", CONFIG.replace("{URL}", standin.url))


def client(gw: Server, key: str = "sk-acme") -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def openai_error(body: bytes) -> dict[str, Any]:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return dict(err)


CHAT = json.dumps({"model": MODEL, "max_tokens": 1,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_authorization_without_bearer_says_so(gateway: Server) -> None:
    for value in ("sk-acme", "Token sk-acme", "Bearer "):
        for method, path, body in (("POST", "/v1/chat/completions", CHAT),
                                   ("GET", "/v1/models", None)):
            code, _, out = http(method, gateway.url + path, body, {"Authorization": value})
            err = openai_error(out)
            assert code == 401 and err["code"] == "invalid_api_key", (value, path, out)
            assert "must be 'Bearer <key>'" in err["message"], (value, path, err)
    code, _, out = http("POST", gateway.url + "/v1/chat/completions", CHAT)
    assert code == 401 and openai_error(out)["message"] == "Missing API key."


def test_unknown_class_names_the_member_or_the_header(gateway: Server) -> None:
    c = client(gateway)
    msgs: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                  extra_body={"qos_class": "gold"})
    assert exc.value.code == "unknown_class" and exc.value.param == "qos_class"
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                  extra_headers={"x-qos-class": "gold"})
    assert exc.value.code == "unknown_class" and exc.value.param == "x-qos-class"
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                  extra_body={"task_type": "poetry"})
    assert exc.value.code == "unknown_task_type" and exc.value.param == "task_type"
    with pytest.raises(openai.BadRequestError) as exc:
        c.embeddings.create(model=MODEL, input="hi", extra_headers={"x-qos-class": "gold"})
    assert exc.value.code == "unknown_class" and exc.value.param == "x-qos-class"


def test_a_tenant_rate_limit_is_named_as_the_tenant_s(gateway: Server) -> None:
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
    gateway: Server, method: str, path: str, allow: str
) -> None:
    code, headers, out = http(method, gateway.url + path, b"{}" if method != "GET" else None,
                              {"Authorization": "Bearer sk-acme"})
    assert code == 405, out
    assert headers["allow"] == allow
    err = openai_error(out)
    assert err["code"] == "method_not_allowed" and err["type"] == "invalid_request_error"
    assert method in err["message"] and allow in err["message"]


def test_unknown_paths_stay_404(gateway: Server) -> None:
    for method in ("GET", "POST"):
        code, _, out = http(method, gateway.url + "/v1/nope", b"{}" if method == "POST" else None)
        assert code == 404 and openai_error(out)["code"] == "not_found"
