"""A tenant's limits as its client sees them, through the official ``openai`` client's raw
response: OpenAI's ``x-ratelimit-*`` headers on every answer (streamed or not, and on the 429
that refuses), only for the limits the tenant has, and the allowance in ``/v1/qos/status``."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from tests.support.inprocess import InProcessGateway
from tests.support.metrics import metric_values
from tests.support.processes import MODEL

CONFIG = """
tenants:
  - name: metered
    api_keys: [sk-metered]
    limits: {requests_per_minute: 3, tokens_per_minute: 6000, max_concurrent: 2}
  - name: free
    api_keys: [sk-free]
engine: {served_model_name: MODEL}
""".replace("MODEL", MODEL)

MESSAGES: Any = [{"role": "user", "content": "hi"}]
RESET = re.compile(r"^(\d+h)?(\d+m)?(\d+(\.\d+)?s|\d+ms)$")  # 20ms, 1s, 8.64s, 6m0s, 1h0m0s
UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


@pytest.fixture(scope="module")
def gateway() -> Iterator[InProcessGateway]:
    with InProcessGateway(CONFIG) as gw:
        yield gw


def seconds(reset: str) -> float:
    assert RESET.match(reset), reset
    return sum(float(n) * UNITS[u] for n, u in re.findall(r"([\d.]+)(ms|h|m|s)", reset))


def limits_told(headers: Any) -> dict[str, str]:
    return {k.lower(): v for k, v in headers.items() if k.lower().startswith("x-ratelimit-")}


def test_each_answer_tells_what_is_left_and_the_429_too(gateway: InProcessGateway) -> None:
    c = gateway.client("sk-metered")
    told = [limits_told(c.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=4).headers)]
    streamed = c.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=4, stream=True)
    told.append(limits_told(streamed.headers))
    for _ in streamed.parse():  # read to its end: the request completes
        pass
    told.append(limits_told(c.chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=4).headers))
    with pytest.raises(openai.RateLimitError) as refused:
        c.chat.completions.with_raw_response.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert refused.value.code == "rate_limit_requests"
    told.append(limits_told(refused.value.response.headers))
    print("\nretry-after:", refused.value.response.headers["retry-after"], end="")
    print("\n" + "\n".join(json.dumps(t, sort_keys=True) for t in told))

    for t in told:
        assert set(t) == {f"x-ratelimit-{what}-{unit}" for what in ("limit", "remaining", "reset")
                          for unit in ("requests", "tokens")}
        assert (t["x-ratelimit-limit-requests"], t["x-ratelimit-limit-tokens"]) == ("3", "6000")
        assert 0 < int(t["x-ratelimit-remaining-tokens"]) < 6000
        assert 0 < seconds(t["x-ratelimit-reset-tokens"]) <= 60
    assert [int(t["x-ratelimit-remaining-requests"]) for t in told] == [2, 1, 0, 0]
    resets = [seconds(t["x-ratelimit-reset-requests"]) for t in told]
    assert 0 < resets[0] <= 20 < resets[1] <= 40 < resets[2] <= 60  # 20 s a request
    assert 40 < resets[3] <= 60
    # beside Retry-After (the time until one request has refilled), not instead of it
    assert 1 <= int(refused.value.response.headers["retry-after"]) <= 20


def test_a_tenant_without_limits_is_told_none(gateway: InProcessGateway) -> None:
    raw = gateway.client("sk-free").chat.completions.with_raw_response.create(
        model=MODEL, messages=MESSAGES, max_tokens=4)
    assert limits_told(raw.headers) == {}


def test_status_shows_the_tenant_s_allowance(gateway: InProcessGateway) -> None:
    code, _, body = gateway.http("GET", gateway.url + "/v1/qos/status",
                                 headers={"Authorization": "Bearer sk-metered"})
    assert code == 200
    allowance = json.loads(body)["allowance"]
    assert set(allowance) == {"requests", "tokens", "concurrent"}
    assert allowance["requests"]["limit"] == 3
    assert 0 <= allowance["requests"]["remaining"] <= 3
    assert 0 <= allowance["requests"]["reset_s"] <= 60
    assert allowance["tokens"]["limit"] == 6000
    assert allowance["concurrent"] == {"in_use": 0, "max": 2}
    code, _, body = gateway.http("GET", gateway.url + "/v1/qos/status",
                                 headers={"Authorization": "Bearer sk-free"})
    assert json.loads(body)["allowance"] == {"concurrent": {"in_use": 0, "max": None}}


def test_the_client_s_default_retries_are_requests_the_gateway_counts() -> None:
    """The openai client's default (two retries, after ``Retry-After``): one call refused is
    three requests refused, each counted; none of them charged the bucket."""
    config = CONFIG + "admission: {max_retry_after_s: 1}\n"  # Retry-After: 1, the shortest
    with InProcessGateway(config) as gw:
        c = gw.client("sk-metered")
        for _ in range(3):
            c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
        with pytest.raises(openai.RateLimitError) as refused:
            c.with_options(max_retries=2).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=4)
        assert refused.value.response.headers["retry-after"] == "1"
        assert refused.value.response.headers["x-ratelimit-remaining-requests"] == "0"
        _, _, body = gw.http("GET", gw.url + "/metrics")
    counted = {dict(k)["outcome"] + "/" + dict(k)["reason"]: v for k, v in
               metric_values(body.decode(), "qosgate_requests_total").items()
               if dict(k)["tenant"] == "metered"}
    assert counted == {"completed/completed": 3, "rejected/rate_limit_requests": 3}
