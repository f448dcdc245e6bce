"""qosgate's order reaches the engine's queue, and a light tenant overtakes a flood there.

The stand-in runs vLLM's priority scheduling (``(priority, arrival)``, smaller first) with two
sequence slots; the gateway's window is fixed at three (no reserve kept for realtime: a request
sent past a full window takes none of it), so one request of the flood waits inside the engine
and the rest in qosgate. A light tenant's request of the same class then arrives: it
is sent past the full window (``qosgate_overtakes_total``) with an engine priority below the
waiting flood request's, and the engine starts it first. Requests go through the official
``openai`` client; the stand-in records every body as it arrives.
"""

from __future__ import annotations

import base64
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import MODEL, Server, start_gateway, start_standin
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

CONFIG = """
policy: qos
fleet: {{window: {{mode: fixed, overtake: {overtake}}}}}
classes:
  - {{name: realtime, level: 0, strict: true, ttft_budget_ms: 1000, queue_timeout_s: 10,
     max_queue: 2000, can_preempt: true}}
  - {{name: api, level: 1, weight: 5, ttft_budget_ms: 5000, queue_timeout_s: 60,
     max_queue: 10000}}
  - {{name: batch, level: 2, weight: 3, ttft_budget_ms: 30000, queue_timeout_s: 600,
     max_queue: 40000, preemptible: true, resume: true}}
  - {{name: offline, level: 3, weight: 2, ttft_budget_ms: 300000, queue_timeout_s: 3600,
     max_queue: 100000, preemptible: true, resume: true}}
tenants:
  - {{name: flood, api_keys: [sk-flood]}}
  - {{name: light, api_keys: [sk-light]}}
upstreams:
  - {{url: {url}, name: engine, max_window: 3, priority_polarity: vllm}}
"""


def _metrics(gw: Server, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    _, _, body = http("GET", gw.url + "/metrics")
    return metric_values(body.decode(), name)


def _run(tmp: Path, overtake: bool) -> tuple[dict[str, float], dict[str, int], float]:
    """Flood: a short and a long stream running, one waiting in the engine, one in qosgate;
    then the light request. First-token times and engine priorities by name, and overtakes."""
    record = tmp / f"arrivals-{overtake}.jsonl"
    si = start_standin(tmp, "--scheduling-policy", "priority", "--max-num-seqs", "2",
                       "--time-scale", "8", "--record", str(record))
    cfg = tmp / f"gw-{overtake}.yaml"
    cfg.write_text(CONFIG.format(url=si.url, overtake=str(overtake).lower()))
    gw = start_gateway(tmp, "--config", str(cfg))
    first: dict[str, float] = {}
    errors: list[BaseException] = []

    def send(name: str, key: str, max_tokens: int) -> threading.Thread:
        def go() -> None:
            try:
                c = OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=120)
                stream = c.completions.create(
                    model=MODEL, prompt=f"{name}: tell a story", max_tokens=max_tokens,
                    stream=True, extra_headers={"x-qos-class": "api"})
                for _ in stream:
                    first.setdefault(name, time.monotonic())
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        th = threading.Thread(target=go, daemon=True)
        th.start()
        return th

    def inflight() -> float:
        return sum(_metrics(gw, "qosgate_inflight").values())

    try:
        # ~10 s at this speed: the rest is sent while it runs
        threads = [send("flood-short", "sk-flood", 100)]
        assert wait_until(lambda: inflight() == 1, 30)
        threads.append(send("flood-long", "sk-flood", 400))
        assert wait_until(lambda: inflight() == 2, 30)
        threads.append(send("flood-waits", "sk-flood", 40))
        assert wait_until(lambda: inflight() == 3, 30)
        threads.append(send("flood-queued", "sk-flood", 40))
        assert wait_until(lambda: sum(_metrics(gw, "qosgate_queue_depth").values()) == 1, 30)
        threads.append(send("light", "sk-light", 4))
        for th in threads:
            th.join(120)
        assert not errors, errors
        overtakes = sum(_metrics(gw, "qosgate_overtakes_total").values())
        outcomes = _metrics(gw, "qosgate_requests_total")
    finally:
        gw.stop()
        si.stop()
    prio: dict[str, int] = {}
    for line in record.read_text().splitlines():
        body: dict[str, Any] = json.loads(base64.b64decode(json.loads(line)["body"]))
        prio[body["prompt"].split(":")[0]] = body["priority"]
    completed = sum(v for k, v in outcomes.items() if ("outcome", "completed") in k)
    assert completed == 5, outcomes  # every request: one outcome
    return first, prio, overtakes


def test_a_light_tenant_overtakes_the_flood_waiting_in_the_engine(tmp_path: Path) -> None:
    first, prio, overtakes = _run(tmp_path, overtake=True)
    assert overtakes == 1
    # its engine priority is below every flood request's still waiting, and the engine (vLLM's
    # priority queue) started it first
    assert prio["light"] < min(prio["flood-waits"], prio["flood-queued"]), prio
    assert first["light"] < first["flood-waits"] < first["flood-queued"], first
    # the flood's own requests keep their order
    assert prio["flood-short"] < prio["flood-long"] < prio["flood-waits"] < prio["flood-queued"]


def test_without_overtaking_it_waits_for_the_slot_after(tmp_path: Path) -> None:
    """``overtake: false``: the light request waits in qosgate for a window slot; by the time a
    flood stream ends, the engine has already started the request it held."""
    first, prio, overtakes = _run(tmp_path, overtake=False)
    assert overtakes == 0
    assert first["flood-waits"] < first["light"], first
    # qosgate still picked it before the flood's queued request, and told the engine so
    assert prio["light"] < prio["flood-queued"], prio
