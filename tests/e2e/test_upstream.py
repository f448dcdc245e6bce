"""End to end through the official ``openai`` client: a gateway with two tenants in front of the
vLLM stand-in (a 2-request window, so queueing is easy to provoke).

Every outcome the tests see is written down in ``SEEN``; the last test checks that
``qosgate_requests_total`` moved by exactly those counts.
"""

from __future__ import annotations

import base64
import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from qosgate.core.queueing.engine_order import band_of
from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import MODEL, Server, start_gateway
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

CONFIG = """
tenants:
  - name: acme
    api_keys: [sk-acme]
    tier: pro
  - name: limited
    api_keys: [sk-limited]
    tier: pro
    limits: {requests_per_minute: 2}
classes:
  - {name: realtime, level: 0, strict: true, ttft_budget_ms: 1000, queue_timeout_s: 10,
     max_queue: 100, can_preempt: true}
  - {name: api, level: 1, weight: 5, ttft_budget_ms: 5000, queue_timeout_s: 60, max_queue: 100}
  - {name: batch, level: 2, weight: 3, ttft_budget_ms: 30000, queue_timeout_s: 60,
     max_queue: 100, preemptible: true}
  - {name: offline, level: 3, weight: 2, ttft_budget_ms: 300000, queue_timeout_s: 0.5,
     max_queue: 1, preemptible: true}
admission: {max_prompt_tokens: 1000}
server: {admin_keys: [sk-admin]}
upstreams:
  - url: {URL}
    name: standin
    max_window: 2
    priority_polarity: vllm
"""

SEEN: Counter[tuple[str, str, str, str]] = Counter()
OK = ("completed", "completed")


def seen(cls: str, tenant: str, outcome: str, reason: str) -> None:
    SEEN[(cls, tenant, outcome, reason)] += 1


@pytest.fixture(scope="module")
def gateway(standin: Server, tmp_session: Path) -> Iterator[Server]:
    cfg = tmp_session / "tenants.yaml"
    cfg.write_text(CONFIG.replace("{URL}", standin.url))
    gw = start_gateway(tmp_session, "--config", str(cfg))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def baseline(gateway: Server) -> dict[Any, float]:
    _, _, text = http("GET", gateway.url + "/metrics")
    return metric_values(text.decode(), "qosgate_requests_total")


def client(gw: Server, key: str = "sk-acme", **kw: Any) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, **kw)


def recorded(standin: Server) -> list[bytes]:
    _, _, body = http("GET", standin.url + "/debug/requests")
    return [base64.b64decode(r["body"]) for r in json.loads(body)["requests"]]


def aborted(standin: Server) -> int:
    _, _, body = http("GET", standin.url + "/debug/requests")
    return int(json.loads(body)["finished"]["abort"])


def status(gw: Server, key: str = "sk-admin") -> dict[str, Any]:
    code, _, body = http("GET", gw.url + "/v1/qos/status",
                         headers={"Authorization": f"Bearer {key}"})
    assert code == 200, body
    return dict(json.loads(body))


def hold_slots(c: OpenAI, n: int = 2) -> list[Any]:
    """Occupy the window with long streams, each past its first token (running)."""
    streams = []
    for _ in range(n):
        s = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "long"}], max_tokens=2000,
            stream=True, extra_headers={"x-qos-class": "api"},
        )
        next(iter(s))
        streams.append(s)
    return streams


def release(gw: Server, streams: list[Any]) -> None:
    for s in streams:
        s.close()
        seen("api", "acme", "cancelled", "client_disconnected")
    assert wait_until(lambda: status(gw)["replicas"]["standin"]["inflight"] == 0)


# ---------------------------------------------------------------------- serving
def test_baseline(baseline: dict[Any, float]) -> None:
    assert isinstance(baseline, dict)


def test_chat_and_completions_streaming_and_not(gateway: Server) -> None:
    c = client(gateway)
    r = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=5
    )
    assert r.choices[0].message.content and r.choices[0].finish_reason == "length"
    assert r.usage is not None and r.usage.completion_tokens == 5
    seen("api", "acme", *OK)

    chunks = list(c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6, stream=True,
    ))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(text.split()) == 6
    assert chunks[-1].choices[0].finish_reason == "length"
    seen("api", "acme", *OK)

    r2 = c.completions.create(model=MODEL, prompt="once upon", max_tokens=4)
    assert r2.choices[0].text and r2.usage is not None and r2.usage.completion_tokens == 4
    seen("api", "acme", *OK)

    parts = list(c.completions.create(model=MODEL, prompt="once", max_tokens=3, stream=True))
    assert "".join(p.choices[0].text for p in parts).split().__len__() == 3
    seen("api", "acme", *OK)

    models = c.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_streamed_output_tokens_are_counted_exactly(gateway: Server) -> None:
    """What a stream is charged (fair share, token limits, the tenant's tokens) is the tokens it
    carried: not the role chunk, the finish chunk, the usage chunk or [DONE] (each was counted
    as a token before)."""

    def output_tokens() -> float:
        _, _, text = http("GET", gateway.url + "/metrics")
        vals = metric_values(text.decode(), "qosgate_tenant_tokens_total")
        return vals.get((("kind", "output"), ("tenant", "acme")), 0.0)

    c = client(gateway)
    for usage in (False, True):
        before = output_tokens()
        chunks = list(c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=4,
            stream=True, stream_options={"include_usage": True} if usage else None,
        ))
        assert sum(1 for ch in chunks if ch.choices and ch.choices[0].delta.content) == 4
        seen("api", "acme", *OK)
        assert wait_until(lambda b=before: output_tokens() > b, timeout=5)
        assert output_tokens() - before == 4, usage
    before = output_tokens()
    parts = list(c.completions.create(model=MODEL, prompt="once", max_tokens=3, stream=True))
    assert sum(1 for p in parts if p.choices and p.choices[0].text) == 3
    seen("api", "acme", *OK)
    assert wait_until(lambda: output_tokens() > before, timeout=5)
    assert output_tokens() - before == 3


def test_qos_inputs_reach_the_engine_in_vllm_polarity(gateway: Server, standin: Server) -> None:
    c = client(gateway)
    cases = [
        ({"extra_body": {"priority": 3}}, "offline", 3),
        ({"extra_headers": {"x-qos-class": "realtime"}}, "realtime", 0),
        ({"extra_body": {"task_type": "summarize"}}, "batch", 2),
        ({"extra_headers": {"x-qos-priority": "0"}}, "realtime", 0),
        ({"extra_body": {"latency_budget_ms": 6000}}, "api", 1),
    ]
    for kw, cls, prio in cases:
        before = len(recorded(standin))
        raw = c.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=2, **kw
        )
        assert raw.headers["x-qosgate-class"] == cls
        raw.parse()
        seen(cls, "acme", *OK)
        bodies = recorded(standin)
        assert len(bodies) == before + 1
        # qosgate's order value (core.queueing.engine_order): the class's band, then its rank in it
        assert band_of(json.loads(bodies[-1])["priority"]) == prio, (kw, bodies[-1])


def _priority_sent(body: bytes) -> int:
    """The top-level priority the engine got (qosgate's order value:
    ``core.queueing.engine_order``)."""
    m = re.search(rb'"priority":(\d+)\s*[,}]', body)
    assert m is not None, body
    return int(m.group(1))


def test_upstream_receives_the_exact_body_bytes(gateway: Server, standin: Server) -> None:
    # odd spacing and key order; a priority inside a string must stay untouched; a client that
    # wants its answer whole gets the engine asked exactly as it asked: priority set, nothing else
    body = (
        b'{ "messages" : [ {"role":"user", "content":"keep \\"priority\\": 9 as is"} ],\n'
        b'  "max_tokens":2,   "model":"' + MODEL.encode() + b'", "priority" : 2 }'
    )
    code, _, out = http("POST", gateway.url + "/v1/chat/completions", body,
                        {"Authorization": "Bearer sk-acme", "Content-Type": "application/json"})
    assert code == 200, out
    seen("batch", "acme", *OK)
    got = recorded(standin)[-1]
    value = _priority_sent(got)  # qosgate's order value, in batch's band
    assert band_of(value) == 2, got
    assert got == body.replace(b'"priority" : 2', b'"priority":' + str(value).encode())

    body2 = b'{"model":"' + MODEL.encode() + b'","prompt":"x y","max_tokens":1}'
    code, _, out = http("POST", gateway.url + "/v1/completions", body2,
                        {"Authorization": "Bearer sk-acme", "x-qos-class": "realtime"})
    assert code == 200, out
    seen("realtime", "acme", *OK)
    got = recorded(standin)[-1]
    value = _priority_sent(got)
    assert band_of(value) == 0  # realtime's band
    assert got == b'{"priority":' + str(value).encode() + b"," + body2[1:]

    body3 = b'{"model":"' + MODEL.encode() + b'","prompt":"x","max_tokens":1,"stream":true}'
    code, _, out = http("POST", gateway.url + "/v1/completions", body3,
                        {"Authorization": "Bearer sk-acme", "x-qos-class": "realtime"})
    assert code == 200, out
    seen("realtime", "acme", *OK)
    got = recorded(standin)[-1]
    value = _priority_sent(got)
    assert band_of(value) == 0
    # a stream that could continue on another call (evicted, or its replica failing) also
    # asks for its token ids, which the client's answer has null as vLLM writes them unasked
    assert got == (b'{"priority":' + str(value).encode() + b',"return_token_ids":true,'
                   + body3[1:])
    body4 = body3.replace(b'"prompt":"x"', b'"prompt":"x","stop":["."]')  # never continued
    code, _, out = http("POST", gateway.url + "/v1/completions", body4,
                        {"Authorization": "Bearer sk-acme", "x-qos-class": "realtime"})
    assert code == 200, out
    seen("realtime", "acme", *OK)
    got = recorded(standin)[-1]
    value = _priority_sent(got)
    assert got == b'{"priority":' + str(value).encode() + b"," + body4[1:]  # as sent


# ---------------------------------------------------------------------- errors
def test_400_malformed_json_and_bad_types(gateway: Server) -> None:
    auth = {"Authorization": "Bearer sk-acme"}
    code, _, out = http("POST", gateway.url + "/v1/chat/completions", b'{"model": ', auth)
    assert code == 400 and json.loads(out)["error"]["code"] == "invalid_json"
    seen("none", "acme", "rejected", "invalid_json")
    bad = b'{"model":"' + MODEL.encode() + b'","messages":[],"max_tokens":"ten"}'
    code, _, out = http("POST", gateway.url + "/v1/chat/completions", bad, auth)
    err = json.loads(out)["error"]
    assert code == 400 and err["code"] == "invalid_body" and err["type"] == "invalid_request_error"
    seen("none", "acme", "rejected", "invalid_body")

    c = client(gateway)
    for max_tokens in (-1, 0, 10**9):
        with pytest.raises(openai.BadRequestError) as exc:
            c.completions.create(model=MODEL, prompt="x", max_tokens=max_tokens)
        assert exc.value.code == "invalid_max_tokens"
        seen("api", "acme", "rejected", "invalid_max_tokens")
    with pytest.raises(openai.BadRequestError) as exc:
        c.completions.create(model=MODEL, prompt="x", extra_headers={"x-qos-class": "gold"})
    assert exc.value.code == "unknown_class"
    seen("none", "acme", "rejected", "unknown_class")


def test_401_missing_or_unknown_key(gateway: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as exc:
        client(gateway, key="sk-nobody").completions.create(model=MODEL, prompt="x")
    assert exc.value.status_code == 401
    seen("none", "unknown", "rejected", "invalid_api_key")
    code, _, out = http("POST", gateway.url + "/v1/completions", b"{}")
    assert code == 401 and json.loads(out)["error"]["code"] == "invalid_api_key"
    seen("none", "unknown", "rejected", "invalid_api_key")


def test_404_unknown_model(gateway: Server) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client(gateway).chat.completions.create(
            model="gpt-9", messages=[{"role": "user", "content": "x"}]
        )
    assert exc.value.code == "model_not_found"
    seen("none", "acme", "rejected", "model_not_found")


def test_a_prompt_over_the_limit_is_a_400_as_from_vllm(gateway: Server) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client(gateway).completions.create(model=MODEL, prompt="x" * 5000, max_tokens=1)
    assert exc.value.status_code == 400 and exc.value.code == "prompt_too_long"
    seen("api", "acme", "rejected", "prompt_too_long")


def test_429_rate_limited_with_retry_after(gateway: Server) -> None:
    c = client(gateway, key="sk-limited")
    for _ in range(2):
        c.completions.create(model=MODEL, prompt="x", max_tokens=1)
        seen("api", "limited", *OK)
    with pytest.raises(openai.RateLimitError) as exc:
        c.completions.create(model=MODEL, prompt="x", max_tokens=1)
    retry = exc.value.response.headers["retry-after"]
    assert retry.isdigit() and 1 <= int(retry) <= 60
    assert exc.value.code == "rate_limit_requests"
    seen("api", "limited", "rejected", "rate_limit_requests")


def test_503_shed_and_504_queue_timeout(gateway: Server) -> None:
    c = client(gateway)
    held = hold_slots(c)
    seen_before = time.monotonic()
    with pytest.raises(openai.APIStatusError) as exc:  # offline: 0.5 s queue timeout
        c.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 3})
    assert exc.value.status_code == 504 and exc.value.code == "queue_timeout"
    assert time.monotonic() - seen_before >= 0.45
    seen("offline", "acme", "timed_out", "queue_timeout")

    # offline holds one queued request at most: the second is shed with 503 + Retry-After
    slow = client(gateway, timeout=5.0)
    import threading

    first_err: list[BaseException] = []

    def queued() -> None:
        try:
            slow.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                    extra_body={"priority": 3})
        except BaseException as e:
            first_err.append(e)

    th = threading.Thread(target=queued)
    th.start()
    assert wait_until(lambda: status(gateway)["classes"]["offline"]["queued"] == 1)
    with pytest.raises(openai.InternalServerError) as exc2:
        c.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={"priority": 3})
    assert exc2.value.status_code == 503 and exc2.value.code == "class_queue_full"
    assert exc2.value.response.headers["retry-after"].isdigit()
    seen("offline", "acme", "rejected", "class_queue_full")
    th.join()
    assert first_err and getattr(first_err[0], "status_code", None) == 504
    seen("offline", "acme", "timed_out", "queue_timeout")
    release(gateway, held)


# ---------------------------------------------------------------------- disconnects
def test_queued_request_is_removed_when_its_client_leaves(gateway: Server,
                                                          standin: Server) -> None:
    c = client(gateway)
    held = hold_slots(c)
    before = len(recorded(standin))
    with pytest.raises(openai.APITimeoutError):
        client(gateway, timeout=0.5).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=2,
            extra_body={"task_type": "summarize"},
        )
    seen("batch", "acme", "cancelled", "client_disconnected")
    assert wait_until(lambda: status(gateway)["classes"]["batch"]["queued"] == 0, 2)
    release(gateway, held)
    time.sleep(0.2)
    assert len(recorded(standin)) == before  # it never reached the engine


def test_running_request_is_aborted_upstream_at_once(gateway: Server, standin: Server) -> None:
    c = client(gateway)
    before = aborted(standin)
    s = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=2000, stream=True,
    )
    next(iter(s))
    t0 = time.monotonic()
    s.close()
    seen("api", "acme", "cancelled", "client_disconnected")
    assert wait_until(lambda: aborted(standin) == before + 1, 3)
    assert time.monotonic() - t0 < 1.0
    assert wait_until(lambda: status(gateway)["replicas"]["standin"]["inflight"] == 0, 2)


# ---------------------------------------------------------------------- status and metrics
def test_status_admin_sees_all_a_tenant_only_itself(gateway: Server) -> None:
    admin = status(gateway, "sk-admin")
    assert set(admin["classes"]) == {"realtime", "api", "batch", "offline"}
    assert "standin" in admin["replicas"] and "queued_total" in admin
    c = client(gateway)
    held = hold_slots(c, 1)
    own = status(gateway, "sk-acme")
    other = status(gateway, "sk-limited")
    assert own["tenant"] == "acme" and own["tenants"]["acme"]["inflight"] == 1
    assert set(own["tenants"]) == {"acme"}
    assert set(other["tenants"]) == {"limited"} and other["replicas"]["standin"]["inflight"] == 0
    code, _, _ = http("GET", gateway.url + "/v1/qos/status",
                      headers={"Authorization": "Bearer sk-bad"})
    assert code == 401
    release(gateway, held)


def test_metrics_counters_equal_the_outcomes_seen(gateway: Server,
                                                  baseline: dict[Any, float]) -> None:
    _, _, text = http("GET", gateway.url + "/metrics")
    now = metric_values(text.decode(), "qosgate_requests_total")
    delta = {k: v - baseline.get(k, 0.0) for k, v in now.items() if v - baseline.get(k, 0.0)}
    expect = {
        (("class", c), ("outcome", o), ("reason", r), ("tenant", t)): float(n)
        for (c, t, o, r), n in SEEN.items()
    }
    assert delta == expect
    for name in ("qosgate_ttft_seconds_count", "qosgate_queue_depth", "qosgate_replica_inflight",
                 "qosgate_e2e_seconds_count", "qosgate_queue_wait_seconds_count"):
        assert metric_values(text.decode(), name), name
