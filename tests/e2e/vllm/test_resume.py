"""Preempt and resume through real vLLM 0.32: an offline stream evicted for realtime requests
(its engine call closed: vLLM aborts it and frees its slot) continues from the token ids it
delivered, and its client gets the very bytes an uninterrupted run gives, the ids and ``created``
aside -- for chat and for completions. A whole answer is restarted, never spliced, and is the same
answer too.

The gateway holds one request at the engine (a window of one), so every realtime request that
arrives while the offline one runs takes its slot.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

import pytest

from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import Server, gateway_from
from tests.support.vllm import MODEL, client, signals, wait_idle
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

CONFIG = """
fleet: {{window: {{mode: fixed}}}}
preemption: {{min_run_s: 0, max_evictions: 8}}
classes:
  - {{name: realtime, level: 0, strict: true, ttft_budget_ms: 60000, queue_timeout_s: 120,
     max_queue: 100, can_preempt: true}}
  - {{name: api, level: 1, weight: 5, ttft_budget_ms: 60000, queue_timeout_s: 120,
     max_queue: 100}}
  - {{name: batch, level: 2, weight: 3, ttft_budget_ms: 300000, queue_timeout_s: 300,
     max_queue: 100, preemptible: true}}
  - {{name: offline, level: 3, weight: 2, ttft_budget_ms: 300000, queue_timeout_s: 300,
     max_queue: 100, preemptible: true, resume: true}}
upstreams:
  - {{url: "{url}", name: v, max_window: 1, priority_polarity: vllm, models: [{model}]}}
"""

OUTPUT = 48  # tokens per answer: long enough that every interruption lands mid-stream
_ID = re.compile(rb'"id":"[^"]*","object":"([^"]*)","created":\d+')


@pytest.fixture(scope="module")
def gw_resume(vllm_priority: Server, vllm_tmp: Path) -> Iterator[Server]:
    yield from gateway_from(vllm_tmp, "gateway-resume.yaml",
                            CONFIG.format(url=vllm_priority.url, model=MODEL))


def _body(route: str, stream: bool, output: int = OUTPUT) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": output, "temperature": 0,
                            "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "Tell me about the history of Rome."}]
    else:
        body["prompt"] = "The history of Rome begins"
    return body


def _interrupt(gw: Server) -> threading.Thread:
    """A realtime request, sent now from a thread: it takes the offline request's slot."""
    def run() -> None:
        client(gw).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
            extra_headers={"x-qos-class": "realtime"})
    t = threading.Thread(target=run)
    t.start()
    return t


def _stream(server: Server, route: str, interrupt_at: tuple[int, ...] = (),
            gw: Server | None = None) -> bytes:
    """The raw SSE bytes of one offline stream; after the k-th event for each k in
    ``interrupt_at``, a realtime request is sent (to ``gw``)."""
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    conn = HTTPConnection("127.0.0.1", server.port, timeout=300)
    conn.request("POST", path, json.dumps(_body(route, True)),
                 {"content-type": "application/json", "x-qos-class": "offline"})
    r = conn.getresponse()
    assert r.status == 200
    out, events, threads = b"", 0, []
    while line := r.readline():
        out += line
        if line.startswith(b"data: "):
            events += 1
            if events in interrupt_at:
                assert gw is not None
                threads.append(_interrupt(gw))
    conn.close()
    for t in threads:
        t.join()
    return out


def _same(raw: bytes) -> bytes:
    """The answer's bytes with its id and creation time taken out (every call has its own)."""
    return _ID.sub(rb'"id":"-","object":"\1","created":0', raw)


def _metric(gw: Server, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    _, _, raw = http("GET", gw.url + "/metrics")
    return metric_values(raw.decode(), name)


def _counter(gw: Server, name: str) -> float:
    return sum(_metric(gw, name).values())


def _aborted(engine: Server, rid: str) -> int:
    """Engine calls of request ``rid`` that vLLM logged as aborted (``--enable-log-requests``;
    vLLM 0.32 counts no client abort in its metrics)."""
    return sum(1 for line in engine.log.read_text().splitlines()
               if rid in line and line.rstrip().endswith(" aborted."))


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_an_evicted_stream_continues_with_the_same_bytes(
    gw_resume: Server, vllm_priority: Server, route: str
) -> None:
    wait_idle(vllm_priority)
    direct = _stream(vllm_priority, route)
    alone = _stream(gw_resume, route)
    evicted0 = _counter(gw_resume, "qosgate_evictions_total")
    wait_idle(vllm_priority)
    evicted = _stream(gw_resume, route, (2, 9, 25), gw_resume)
    m = re.search(rb'"id":"(?:chatcmpl|cmpl)-([^"]*)"', evicted)
    assert m is not None
    rid = m.group(1).decode()
    evictions = _counter(gw_resume, "qosgate_evictions_total") - evicted0
    # through the gateway, uninterrupted, the bytes are vLLM's own (the ids it asked for
    # written null again, as vLLM writes them unasked)
    assert _same(alone) == _same(direct)
    # evicted, resumed: the same bytes, one [DONE], the usage of the client's prompt
    assert _same(evicted) == _same(direct)
    assert evicted.count(b"data: [DONE]") == 1
    assert evictions >= 1
    # each eviction closed its engine call, and vLLM aborted it (freeing its slot and KV)
    wait_idle(vllm_priority)
    assert wait_until(lambda: _aborted(vllm_priority, rid) == evictions, 30), (
        _aborted(vllm_priority, rid), evictions)
    resumed = _metric(gw_resume, "qosgate_resumes_total")
    assert resumed.get((("class", "offline"),), 0) >= evictions


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_a_whole_answer_pulled_back_is_run_again_not_spliced(
    gw_resume: Server, vllm_priority: Server, route: str
) -> None:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    # long enough to be still running when the realtime request comes
    body = json.dumps(_body(route, False, 4 * OUTPUT)).encode()
    headers = {"content-type": "application/json", "x-qos-class": "offline"}
    status, _, alone = http("POST", gw_resume.url + path, body, headers, timeout=300)
    assert status == 200
    preempted0 = _counter(gw_resume, "qosgate_preemptions_total")
    result: list[bytes] = []
    t = threading.Thread(target=lambda: result.append(
        http("POST", gw_resume.url + path, body, headers, timeout=300)[2]))
    t.start()
    # once it runs in vLLM (its /metrics say so), a realtime request takes its slot
    wait_until(lambda: (signals(vllm_priority).running or 0) >= 1, timeout=120)
    _interrupt(gw_resume).join()
    t.join()
    assert _counter(gw_resume, "qosgate_preemptions_total") - preempted0 >= 1
    assert _same(result[0]) == _same(alone)
    assert json.loads(result[0])["usage"]["completion_tokens"] == 4 * OUTPUT
