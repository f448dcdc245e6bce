"""A tenant's limit on one model, through real processes: gateways in front of two stand-ins,
one serving model A and one model B.

The official ``openai`` client (``max_retries=0``, so the 429 shows) is refused on model A with a
``Retry-After`` and a message naming the model and its limit, while the same key is still served
on model B; and with two gateways sharing a redis-server, the limit on A holds across both, not
once per gateway.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis

from tests.support.processes import Server, start_gateway, start_standin
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.e2e

A, B = "model-a", "model-b"
MESSAGES: Any = [{"role": "user", "content": "hello"}]
SHARED_RPM = 4


class TwoModels:
    """A stand-in for each model; a gateway in front of them on its own, and two more sharing
    a redis-server."""

    def __init__(self, tmp: Path) -> None:
        self.redis = RedisServer(tmp)
        self.started: list[Server] = []
        try:
            self.standins = [self._up(start_standin(tmp, "--served-model-name", m,
                                                    "--time-scale", "0.01")) for m in (A, B)]
            cfg = tmp / "two-models.yaml"
            cfg.write_text(f"""
tenants:
  - name: solo
    api_keys: [sk-solo]
    limits: {{models: {{{A}: {{requests_per_minute: 2}}}}}}
  - name: fleet
    api_keys: [sk-fleet]
    limits: {{models: {{{A}: {{requests_per_minute: {SHARED_RPM}}}}}}}
server: {{admin_keys: [sk-admin]}}
upstreams:
  - {{url: {self.standins[0].url}, name: a, models: [{A}]}}
  - {{url: {self.standins[1].url}, name: b, models: [{B}]}}
""")
            self.alone = self._up(start_gateway(tmp, "--config", str(cfg)))
            self.shared = [self._up(start_gateway(tmp, "--config", str(cfg), "--redis",
                                                  self.redis.url, "--instance-id", f"gw{i}"))
                           for i in range(2)]
        except BaseException:
            self.close()
            raise

    def _up(self, server: Server) -> Server:
        self.started.append(server)
        return server

    def close(self) -> None:
        for s in reversed(self.started):
            s.stop()
        self.redis.stop()


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoModels]:
    t = TwoModels(tmp_path_factory.mktemp("two-models"))
    yield t
    t.close()


def _client(gw: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def _ask(c: openai.OpenAI, model: str) -> Any:
    return c.chat.completions.with_raw_response.create(model=model, messages=MESSAGES,
                                                        max_tokens=2)


def _served(c: openai.OpenAI, model: str) -> bool:
    """One request on ``model``: True if served, False if refused by a limit (429)."""
    try:
        _ask(c, model)
    except openai.RateLimitError:
        return False
    return True


def test_the_openai_client_is_refused_on_model_a_and_served_on_model_b(two: TwoModels) -> None:
    c = _client(two.alone, "sk-solo")
    assert [_ask(c, A).status_code for _ in range(2)] == [200, 200]
    with pytest.raises(openai.RateLimitError) as refused:
        _ask(c, A)
    err = refused.value
    headers = err.response.headers
    print(f"\n429 on {A}: code={err.code} retry-after={headers['retry-after']} "
          f"retry-after-ms={headers.get('retry-after-ms')}\n  {err.message}")
    assert err.code == "model_rate_limit_requests"
    assert f"on model '{A}'" in err.message and "requests_per_minute" in err.message
    assert 1 <= int(headers["retry-after"]) <= 60
    assert headers["x-ratelimit-limit-requests"] == "2"
    assert headers["x-ratelimit-remaining-requests"] == "0"

    on_b = [_ask(c, B) for _ in range(3)]  # the same key, another model: served
    for raw in on_b:
        answer = raw.parse()
        assert raw.status_code == 200 and answer.model == B
        assert "x-ratelimit-limit-requests" not in raw.headers  # no limit on B to tell
    print(f"served on {B}: {[r.status_code for r in on_b]}")


def test_two_gateways_share_the_limit_on_a_model(two: TwoModels) -> None:
    clients = [_client(gw, "sk-fleet") for gw in two.shared]
    # both gateways see demand until the fleet's budget on A is spent: each leases what the
    # store still holds, and a request is refused where its gateway holds none
    outcomes: Counter[tuple[int, bool]] = Counter()
    start = time.monotonic()
    while time.monotonic() - start < 2.0:
        for i, c in enumerate(clients):
            outcomes[(i, _served(c, A))] += 1
    served = outcomes[(0, True)] + outcomes[(1, True)]
    elapsed = time.monotonic() - start
    print(f"\nserved on {A} over both gateways in {elapsed:.1f} s: {served} "
          f"(gw0 {outcomes[(0, True)]}, gw1 {outcomes[(1, True)]}; refused "
          f"{outcomes[(0, False)] + outcomes[(1, False)]}); the limit is {SHARED_RPM}/min")
    # the fleet's bucket and what it refilled meanwhile, not the limit once per gateway
    assert 1 <= served <= SHARED_RPM + 1
    assert outcomes[(0, False)] and outcomes[(1, False)]  # each gateway refused some
    assert all(_served(c, B) for c in clients)  # B is served on both
    # the fleet's bucket of the limit on A, beside (never under) the tenant's own keys
    store = redis.Redis.from_url(two.redis.url, decode_responses=True)
    assert store.exists(f'qosgate:b:rpm/model:["fleet", "{A}"]')
    store.close()
