"""Nothing gets past the gateway, nothing crashes it, in this process (the simulated engine):
deeply nested and invalid UTF-8 bodies, malformed ``messages`` and prompts, type errors and
limits are honest 400s (or 413s), each counted once; ``/health``, ``x-api-key``, a whole
response's ``Content-Length`` and a class named in any case; a queue timeout after a stream's
early head is an error event. What needs a real server or an
upstream (connections, framing, timeouts, shutdown, the stand-in's view) is
``tests/e2e/test_abuse.py``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from tests.support.answers import CHAT, HI, MALFORMED, TENANTS, is_openai_error, post, total
from tests.support.inprocess import InProcessGateway

SIM = "qosgate-sim"


@pytest.fixture(scope="module")
def sim_gw() -> Iterator[InProcessGateway]:
    """Only basic options (tenants, admin keys, the simulated engine): what these tests pin needs
    no option switched on."""
    with InProcessGateway(TENANTS + """
server: {admin_keys: [sk-admin]}
engine: {kind: sim, time_scale: 0.02, eos_after: 8}
""") as gw:
        yield gw


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"messages":' + b"[" * 1000 + b"]" * 1000 + b"}", "json_too_deep"),
        (b'{"messages":[{"role":"user","content":' + b"[" * 300 + b"]" * 300 + b"}]}",
         "json_too_deep"),
        (b'{"model":"\xff\xfe","messages":[{"role":"user","content":"x"}]}', "invalid_utf8"),
        (b'{"messages":[{"role":"user","content":"caf\xe9"}]}', "invalid_utf8"),
        (b'{"messages":[{"role":"user","content":"\\ud800"}]}', "invalid_json"),
    ],
)
def test_deep_nesting_and_invalid_utf8_are_counted_400s(sim_gw: InProcessGateway, body: bytes,
                                                          code: str) -> None:
    before = total(sim_gw)
    status, _, out = post(sim_gw, body)
    assert status == 400 and is_openai_error(out)["code"] == code
    assert total(sim_gw) == before + 1


@pytest.mark.parametrize("messages", MALFORMED)
def test_malformed_messages_are_400_in_process(sim_gw: InProcessGateway, messages: bytes) -> None:
    before = total(sim_gw)
    code, _, out = post(sim_gw, b'{"max_tokens":1,"messages":' + messages + b"}")
    err = is_openai_error(out)
    assert code == 400 and err["code"] == "invalid_body" and err["param"].startswith("messages")
    assert total(sim_gw) == before + 1


@pytest.mark.parametrize("prompt", [b"5", b"{}", b"[]", b"null", b"[{}]", b'["a", 1]', b"[[]]"])
def test_malformed_prompt_is_400(sim_gw: InProcessGateway, prompt: bytes) -> None:
    code, _, out = post(sim_gw, b'{"max_tokens":1,"prompt":' + prompt + b"}",
                        path="/v1/completions")
    assert code == 400 and is_openai_error(out)["param"] == "prompt"


def test_type_errors_name_the_param_and_limits_say_the_limit(sim_gw: InProcessGateway) -> None:
    code, _, out = post(sim_gw, b'{"messages":[{"role":"user","content":"x"}],"max_tokens":"ten"}')
    assert code == 400 and is_openai_error(out)["param"] == "max_tokens"
    code, _, out = post(sim_gw, b'{"messages":[{"role":"user","content":"x"}],"stream":"yes"}')
    assert code == 400 and is_openai_error(out)["param"] == "stream"
    code, _, out = post(sim_gw, json.dumps({"messages": HI, "max_tokens": 10**6}).encode())
    err = is_openai_error(out)
    assert code == 400 and err["param"] == "max_tokens" and "500" in err["message"]
    code, _, out = post(sim_gw, json.dumps({"prompt": "x" * 8000, "max_tokens": 1}).encode(),
                        path="/v1/completions")
    err = is_openai_error(out)
    assert code == 400 and err["param"] == "prompt" and "1000" in err["message"]
    code, _, out = post(sim_gw, json.dumps({"messages": HI}).encode(), key="sk-nobody")
    assert code == 401


def test_health_x_api_key_content_length_and_class_case(sim_gw: InProcessGateway) -> None:
    code, hdrs, body = sim_gw.http("GET", sim_gw.url + "/health")
    assert code == 200 and hdrs["content-length"] == str(len(body))
    body = json.dumps({"messages": HI, "max_tokens": 2}).encode()
    code, hdrs, out = sim_gw.http("POST", sim_gw.url + CHAT, body,
                           {"x-api-key": "sk-acme", "x-qos-class": "REALTIME"})
    assert code == 200, out
    assert hdrs["content-length"] == str(len(out)) and "transfer-encoding" not in hdrs
    assert hdrs["x-qosgate-class"] == "realtime"
    code, _, out = sim_gw.http("POST", sim_gw.url + CHAT, json.dumps(
        {"messages": HI, "max_tokens": 2, "qos_class": "Batch"}).encode(),
        {"x-api-key": "sk-acme"})
    assert code == 200, out
    code, hdrs, out = sim_gw.http("POST", sim_gw.url + CHAT, b"{", {"x-api-key": "sk-acme"})
    assert code == 400 and hdrs["content-length"] == str(len(out))


def test_a_queue_timeout_after_the_early_head_is_an_error_event() -> None:
    with InProcessGateway("""
classes:
  - {name: realtime, level: 0, strict: true, ttft_budget_ms: 1000, queue_timeout_s: 10,
     max_queue: 100}
  - {name: api, level: 1, weight: 5, ttft_budget_ms: 5000, queue_timeout_s: 1.0, max_queue: 100}
task_types: {chat: realtime}
server: {sse_keepalive_s: 0.2}
engine: {kind: sim, time_scale: 0.5, max_window: 1}   # the 2000-token stream holds it seconds
""") as gw:
        c = gw.client("x")
        hold = c.chat.completions.create(model=SIM, messages=HI, max_tokens=2000, stream=True)
        next(iter(hold))
        queued = c.chat.completions.create(model=SIM, messages=HI, max_tokens=2, stream=True)
        with pytest.raises(openai.APIError) as exc:
            list(queued)
        assert "waited too long" in str(exc.value.message)
        hold.close()
