"""What the abuse tests send and how they read the answers, the same against a gateway process
(``tests/e2e/test_abuse.py``) and one in this process (``tests/server/test_abuse.py``): the
tenants they configure, the malformed ``messages`` they send, a POST, an answer in OpenAI's
error format, the count of requests in ``qosgate_requests_total``."""

from __future__ import annotations

import json
from typing import Any, Protocol

from tests.support.metrics import metric_values

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]

TENANTS = """
tenants:
  - {name: acme, api_keys: [sk-acme], tier: pro}
  - {name: beta, api_keys: [sk-beta], tier: pro}
  - {name: gamma, api_keys: [sk-gamma], tier: pro}
  - {name: clamped, api_keys: [sk-clamped], tier: pro, allowed_classes: [batch, offline]}
admission: {max_prompt_tokens: 1000, max_output_tokens: 500}
"""

MALFORMED = [b"5", b'"hi"', b"{}", b"[]", b"null", b"[1]", b'[{"content":"x"}]',
             b'[{"role":"user","content":5}]']


class Reachable(Protocol):
    """A gateway a test can ask: a process (``processes.Server``) or one in this process
    (``inprocess.InProcessGateway``)."""

    url: str

    def http(self, method: str, url: str, body: bytes | None = None,
             headers: dict[str, str] | None = None, timeout: float = 10,
             ) -> tuple[int, dict[str, str], bytes]: ...


def total(gw: Reachable, key: str | None = None) -> float:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    code, _, body = gw.http("GET", gw.url + "/metrics", headers=headers)
    assert code == 200, body
    return sum(metric_values(body.decode(), "qosgate_requests_total").values())


def is_openai_error(body: bytes) -> dict[str, Any]:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and isinstance(err["type"], str)
    return dict(err)


def post(gw: Reachable, body: bytes, key: str = "sk-acme", path: str = CHAT,
         headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    h.update(headers or {})
    return gw.http("POST", gw.url + path, body, h)
