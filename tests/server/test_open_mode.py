"""The gateway with no configuration (open mode, the built-in simulated engine), in this
process: its health, readiness, status and metrics routes, an unknown path, a stream the client
closes while it runs, an unknown model. (``qosgate serve`` as a process:
``tests/e2e/test_sim_engine.py``.)"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.support.inprocess import InProcessGateway
from tests.support.waiting import wait_until


@pytest.fixture(scope="module")
def gateway() -> Iterator[InProcessGateway]:
    """A gateway that has answered one completion (its metrics have a completed request)."""
    with InProcessGateway() as gw:
        gw.client().completions.create(model="qosgate-sim", prompt="abc", max_tokens=3)
        yield gw


def test_health_ready_status_metrics(gateway: InProcessGateway) -> None:
    assert gateway.http("GET", gateway.url + "/healthz")[0] == 200
    assert gateway.http("GET", gateway.url + "/readyz")[0] == 200
    code, _, body = gateway.http("GET", gateway.url + "/v1/qos/status")
    view = json.loads(body)
    assert code == 200 and view["replicas"]["sim-0"]["capacity"] == 64
    code, hdrs, body = gateway.http("GET", gateway.url + "/metrics")
    assert code == 200 and hdrs["content-type"].startswith("text/plain")
    assert b'qosgate_requests_total{class="api",outcome="completed"' in body
    assert gateway.http("GET", gateway.url + "/nope")[0] == 404


def test_cancel_running_in_process(gateway: InProcessGateway) -> None:
    c = gateway.client("x")
    s = c.completions.create(model="qosgate-sim", prompt="abc", max_tokens=5000, stream=True)
    next(iter(s))

    def inflight() -> int:
        return int(json.loads(gateway.http("GET", gateway.url + "/v1/qos/status")[2])
                   ["replicas"]["sim-0"]["inflight"])

    assert inflight() == 1
    s.close()
    assert wait_until(lambda: inflight() == 0, 2)
    with pytest.raises(openai.NotFoundError):
        c.completions.create(model="other", prompt="x")
