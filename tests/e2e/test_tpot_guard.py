"""The TPOT guard end to end: a real gateway scrapes a stand-in's ``/metrics`` (its
``vllm:inter_token_latency_seconds`` sum and count), and while the engine streams to realtime
slower than the guard allows, an api request waits in qosgate's queue instead of joining the
engine's batch beside a batch-class stream already there (one request of the other classes at a
time still goes: no starvation); when the realtime stream ends, it goes.

The stand-in runs at 40x modelled time: one sequence's step (about 7 ms on the modelled H100)
takes about 280 ms, past a guard at 0.5 x realtime's 200 ms TPOT budget (100 ms). Every wait is
on a condition, bounded.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator

import pytest
from openai import OpenAI

from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import MODEL, Server, start_gateway, start_standin
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Server]]:
    tmp = tmp_path_factory.mktemp("tpot_guard")
    engine = start_standin(tmp, "--scheduling-policy", "priority", "--time-scale", "40")
    cfg = {
        "upstreams": [{"url": engine.url, "name": "r0", "max_window": 16,
                       "priority_polarity": "vllm"}],
        "fleet": {"tpot_guard": 0.5, "window": {"mode": "fixed"}},
    }
    path = tmp / "gateway.json"
    path.write_text(json.dumps(cfg))
    gateway = start_gateway(tmp, "--config", str(path))
    try:
        yield engine, gateway
    finally:
        gateway.stop()
        engine.stop()


def _metric(gw: Server, name: str, **labels: str) -> float | None:
    _, _, body = http("GET", gw.url + "/metrics")
    hits = [v for k, v in metric_values(body.decode(), name).items()
            if all((lk, lv) in k for lk, lv in labels.items())]
    return sum(hits) if hits else None


def test_a_slow_engine_streaming_realtime_holds_the_other_classes(
    fleet: tuple[Server, Server],
) -> None:
    _, gw = fleet
    client = OpenAI(base_url=gw.url + "/v1", api_key="sk-test", max_retries=0, timeout=60)
    background = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "a long report"}], max_tokens=400,
        stream=True, extra_headers={"x-qos-class": "batch"},
    )
    next(iter(background))  # one request of the other classes runs on r0
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=60, stream=True,
        extra_headers={"x-qos-class": "realtime"},
    )
    chunks = iter(stream)
    next(chunks)  # streaming: the replica now serves realtime
    # two scrapes give the engine's time per token; past 100 ms the guard holds the others
    assert wait_until(lambda: _metric(gw, "qosgate_replica_others_held", replica="r0") == 1,
                      timeout=15), "the guard never held r0"
    itl = _metric(gw, "qosgate_replica_engine_itl_seconds", replica="r0")
    assert itl is not None and itl > 0.1
    # the hold point: 0.5 x realtime's 200 ms (a fixed guard does not learn)
    assert _metric(gw, "qosgate_replica_tpot_guard_seconds", replica="r0") == pytest.approx(0.1)

    answer: list[str] = []

    def api_request() -> None:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=2,
            extra_headers={"x-qos-class": "api"},
        )
        answer.append(r.choices[0].message.content or "")

    t = threading.Thread(target=api_request, daemon=True)
    t.start()
    assert wait_until(lambda: _metric(gw, "qosgate_queue_depth", **{"class": "api"}) == 1,
                      timeout=10), "the api request was not held in qosgate's queue"
    assert not answer
    for _ in chunks:  # the realtime stream ends: nothing left to protect
        pass
    t.join(timeout=30)
    assert answer, "the api request was not served once realtime finished"
    assert _metric(gw, "qosgate_queue_depth", **{"class": "api"}) == 0
    background.close()
