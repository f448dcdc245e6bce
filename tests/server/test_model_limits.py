"""A tenant's limit on one model as the gateway answers it, in process through the official
``openai`` client: the 429 names the model and its limit, with ``Retry-After`` and
``retry-after-ms``; the ``x-ratelimit-*`` headers tell the model's limit where it binds first;
the refusal is counted under its own reason; a limit on another model refuses nothing here."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from tests.support.inprocess import InProcessGateway
from tests.support.metrics import metric_values
from tests.support.processes import MODEL

CONFIG = """
tenants:
  - name: capped
    api_keys: [sk-capped]
    limits:
      requests_per_minute: 100
      models: {MODEL: {requests_per_minute: 2}}
  - name: elsewhere
    api_keys: [sk-elsewhere]
    limits: {models: {other-model: {requests_per_minute: 1, max_concurrent: 1}}}
engine: {served_model_name: MODEL}
""".replace("MODEL", MODEL)

MESSAGES: Any = [{"role": "user", "content": "hi"}]


def test_a_limit_on_the_model_refuses_naming_it_and_tells_its_allowance() -> None:
    with InProcessGateway(CONFIG) as gw:
        c = gw.client("sk-capped")
        told = [c.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=4).headers for _ in range(2)]
        with pytest.raises(openai.RateLimitError) as refused:
            c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        _, _, metrics = gw.http("GET", gw.url + "/metrics")
        _, _, status = gw.http("GET", gw.url + "/v1/qos/status",
                               headers={"authorization": "Bearer sk-capped"})
    view = json.loads(status)
    # the status tells the model's allowance beside the tenant's over all models
    assert view["allowance"]["requests"]["limit"] == 100
    assert view["model_allowance"][MODEL]["requests"]["limit"] == 2
    assert view["model_allowance"][MODEL]["requests"]["remaining"] == 0
    err = refused.value
    assert err.code == "model_rate_limit_requests"
    assert err.type == "rate_limit_error"
    assert (f"Tenant 'capped' reached its request rate limit on model '{MODEL}' "
            f"(limits.models.{MODEL}.requests_per_minute): 2 requests per minute") in err.message
    headers = err.response.headers
    assert 29 <= int(headers["retry-after"]) <= 30  # a request refills in 30 s at 2 a minute
    assert 29_000 <= int(headers["retry-after-ms"]) <= 30_000
    # the model's limit binds first: its bucket is what the headers tell, not the tenant's 100
    assert [h["x-ratelimit-limit-requests"] for h in (*told, headers)] == ["2"] * 3
    assert [h["x-ratelimit-remaining-requests"] for h in (*told, headers)] == ["1", "0", "0"]
    counted = {dict(k)["outcome"] + "/" + dict(k)["reason"]: v for k, v in
               metric_values(metrics.decode(), "qosgate_requests_total").items()
               if dict(k)["tenant"] == "capped"}
    assert counted == {"completed/completed": 2, "rejected/model_rate_limit_requests": 1}


def test_a_limit_on_another_model_refuses_nothing_here() -> None:
    with InProcessGateway(CONFIG) as gw:
        c = gw.client("sk-elsewhere")
        raws = [c.chat.completions.with_raw_response.create(
            model=MODEL, messages=MESSAGES, max_tokens=4) for _ in range(4)]
    assert [r.status_code for r in raws] == [200] * 4
    assert not any(k.startswith("x-ratelimit-") for r in raws for k in r.headers)
