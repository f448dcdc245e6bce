"""The pieces behind test_abuse.py, without servers: the request reader's checks (nesting, keys,
shapes), the member splice, the response sink (Content-Length, the early SSE head, an error after
it), the tenant label cap and the limit messages."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.config import default_config
from qosgate.core import QosInputs, Scheduler
from qosgate.server.asgi import AsgiSink, Message
from qosgate.server.errors import outcome_error
from qosgate.server.metrics import GatewayMetrics
from qosgate.wire.json_guards import (
    MAX_JSON_DEPTH,
    BadBody,
    check_depth,
    json_depth,
    top_level_keys,
)
from qosgate.wire.parse import estimate_prompt_tokens, parse_body
from qosgate.wire.splice import set_member, set_priority
from qosgate.wire.textreq import BadTextRequest, parse_text_request

MSG = b'[{"role":"user","content":"x"}]'


# ---------------------------------------------------------------------- nesting
def depth_of(obj: Any) -> int:
    if isinstance(obj, list):
        return 1 + max((depth_of(x) for x in obj), default=0)
    if isinstance(obj, dict):
        return 1 + max((depth_of(x) for x in obj.values()), default=0)
    return 0


_tricky = st.sampled_from(["[", "]", "{", "}", '"', "\\", '\\"', "\\\\", '"]', "x", "é", "\n"])
_values = st.recursive(
    st.none() | st.integers() | st.lists(_tricky, max_size=4).map("".join),
    lambda kids: st.lists(kids, max_size=3)
    | st.dictionaries(st.lists(_tricky, max_size=3).map("".join), kids, max_size=3),
    max_leaves=20,
)


@settings(max_examples=300, derandomize=True, deadline=None)
@given(obj=_values, ascii_only=st.booleans(), indent=st.booleans())
def test_json_depth_counts_brackets_outside_strings_only(obj: Any, ascii_only: bool,
                                                         indent: bool) -> None:
    body = json.dumps(obj, ensure_ascii=ascii_only, indent=1 if indent else None).encode()
    assert json_depth(body) == depth_of(obj)


def test_nesting_over_the_limit_is_refused_under_it_read() -> None:
    n = MAX_JSON_DEPTH - 3  # inside {"messages": [{"content": ...}]}
    ok = b'{"messages":[{"role":"user","content":' + b"[" * n + b"]" * n + b"}]}"
    parse_body(ok, "chat")
    deep = b'{"messages":[{"role":"user","content":' + b"[" * (n + 1) + b"]" * (n + 1) + b"}]}"
    with pytest.raises(BadBody) as exc:
        parse_body(deep, "chat")
    assert exc.value.code == "json_too_deep" and str(MAX_JSON_DEPTH) in str(exc.value)
    # brackets inside strings are text, however many
    parse_body(b'{"messages":[{"role":"user","content":"' + b"[" * 5000 + b'"}]}', "chat")
    check_depth(b"[" * 10)  # short: nothing to scan


# ---------------------------------------------------------------------- keys
def test_top_level_keys_are_raw_and_only_top_level() -> None:
    body = b'{"a":1, "b" : {"a":2,"c":[{"d":3}]}, "p\\u0072ompt":"x:\\"y\\"", "a":[]}'
    assert top_level_keys(body) == [b'"a"', b'"b"', b'"p\\u0072ompt"', b'"a"']


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"messages":M,"stream":true,"stream":false}', "stream"),
        (b'{"messages":M,"qos_class":"batch","qos_cl\\u0061ss":"realtime"}', "qos_class"),
        (b'{"messages":M,"t\\u0061sk_type":"chat"}', "task_type"),
        (b'{"messages":M,"messages":M}', "messages"),
        (b'{"prompt":"a","prompt":"b","messages":M}', "prompt"),
        (b'{"messages":M,"latency_budget_ms":5,"latency_budget_ms":null}', "latency_budget_ms"),
    ],
)
def test_duplicated_or_escaped_keys_are_refused(body: bytes, param: str) -> None:
    with pytest.raises(BadBody) as exc:
        parse_body(body.replace(b"M", MSG))
    assert (exc.value.code, exc.value.param) == ("duplicate_key", param)


def test_keys_not_acted_on_and_nested_ones_are_left_alone() -> None:
    body = (b'{"messages":[{"role":"user","content":"\\u00e9 \\"messages\\": 1"}],'
            b'"temp\\u0065rature":1,"x":1,"x":2,"tools":[{"messages":[],"priority":1}],'
            b'"metadata":{"model":"a","model":"b"}}')
    b = parse_body(body, "chat")
    assert len(b.messages) and estimate_prompt_tokens(b) == len(b.messages) // 4


def test_null_versus_absent_is_known_for_the_splice() -> None:
    b = parse_body(b'{"messages":' + MSG + b',"max_tokens":null,"priority":null}', "chat")
    assert b.max_tokens is None and b.has_max_tokens and b.priority is None
    b = parse_body(b'{"messages":' + MSG + b"}", "chat")
    assert not b.has_max_tokens and b.priority is msgspec.UNSET


def test_estimate_counts_the_messages_span() -> None:
    msgs = json.dumps([{"role": "user", "content": "x" * 400}]).replace(" ", "").encode()
    b = parse_body(b'{"messages":' + msgs + b"}", "chat")
    assert estimate_prompt_tokens(b) == len(msgs) // 4


def test_invalid_utf8_anywhere_is_refused() -> None:
    for body in (b'{"model":"\xc3"}', b'{"messages":[{"role":"user","content":"\xed\xa0\x80"}]}',
                 b'{"x":"\xff","messages":' + MSG + b"}"):
        with pytest.raises(BadBody) as exc:
            parse_body(body, "chat")
        assert exc.value.code == "invalid_utf8"


# ---------------------------------------------------------------------- splice
def test_a_ceiling_is_inserted_or_set() -> None:
    def cap(body: bytes, present: bool) -> bytes:
        return set_member(body, "max_tokens", 7, present)

    assert cap(b'{"a":1}', False) == b'{"max_tokens":7,"a":1}'
    assert cap(b"{}", False) == b'{"max_tokens":7}'
    assert cap(b'{"max_tokens": null, "a":1}', True) == b'{"max_tokens":7, "a":1}'
    nested = b'{"tools":{"max_tokens":1},"max_tokens":null}'
    assert json.loads(cap(nested, True)) == {"tools": {"max_tokens": 1}, "max_tokens": 7}


def test_an_escaped_duplicate_cannot_survive_the_splice() -> None:
    # even without the parser's refusal, the splice re-encodes when a key could be escaped
    body = b'{"priority":3,"pr\\u0069ority":-100,"messages":[]}'
    out = set_priority(body, 2, True)
    assert out.count(b"priority") == 1 and json.loads(out)["priority"] == 2
    assert json.loads(set_priority(body, None, True)) == {"messages": []}
    nested_only = b'{"tools":[{"priority":1}],"pr\\u0069ority":0}'
    assert json.loads(set_member(nested_only, "priority", 3, True)) == {
        "tools": [{"priority": 1}], "priority": 3}


# ---------------------------------------------------------------------- textreq (llama.cpp)
@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (b'"tools":[{"type":"function"}]', "tools"),
        (b'"functions":[{"name":"f"}]', "functions"),
        (b'"logprobs":true', "logprobs"),
        (b'"top_logprobs":2', "top_logprobs"),
    ],
)
def test_text_engine_refuses_what_it_cannot_do(extra: bytes, param: str) -> None:
    with pytest.raises(BadTextRequest) as exc:
        parse_text_request(b'{"messages":' + MSG + b"," + extra + b"}", "chat")
    assert exc.value.param == param
    parse_text_request(b'{"messages":' + MSG + b',"tools":[],"logprobs":false}', "chat")


def test_text_engine_names_the_param_of_a_type_error() -> None:
    with pytest.raises(BadTextRequest) as exc:
        parse_text_request(b'{"messages":[{"role":"user","content":5}]}', "chat")
    assert exc.value.param == "messages[0].content"


# ---------------------------------------------------------------------- the sink
class Recorder:
    def __init__(self) -> None:
        self.sent: list[Message] = []

    async def __call__(self, msg: Message) -> None:
        self.sent.append(msg)


def _headers(msg: Message) -> dict[bytes, bytes]:
    return dict(msg["headers"])


def test_a_whole_response_has_a_content_length() -> None:
    rec = Recorder()
    sink = AsgiSink(rec, [(b"x-a", b"1")])

    async def go() -> None:
        await sink.start(200, [(b"content-type", b"application/json")])
        await sink.send(b'{"ok":1}', False)

    asyncio.run(go())
    head, body = rec.sent
    assert _headers(head)[b"content-length"] == b"8" and _headers(head)[b"x-a"] == b"1"
    assert body["body"] == b'{"ok":1}' and not body["more_body"]


def test_a_stream_has_none_and_keeps_its_parts() -> None:
    rec = Recorder()
    sink = AsgiSink(rec)

    async def go() -> None:
        await sink.start(200, [(b"content-type", b"text/event-stream")])
        await sink.send(b"data: 1\n\n")
        await sink.send(b"data: [DONE]\n\n", False)

    asyncio.run(go())
    assert b"content-length" not in _headers(rec.sent[0])
    assert [m["body"] for m in rec.sent[1:]] == [b"data: 1\n\n", b"data: [DONE]\n\n"]


def test_keep_alives_then_the_engine_stream() -> None:
    rec = Recorder()
    sink = AsgiSink(rec, [(b"x-qosgate-class", b"api")])

    async def go() -> None:
        loop = asyncio.get_running_loop()
        assert sink.keepalive(loop)
        await asyncio.sleep(0)
        assert sink.keepalive(loop)
        await asyncio.sleep(0)
        await sink.start(200, [(b"content-type", b"text/event-stream")])
        assert not sink.keepalive(loop)  # the engine's now
        await sink.send(b"data: 1\n\n")
        await sink.send(b"data: [DONE]\n\n", False)

    asyncio.run(go())
    head = rec.sent[0]
    assert head["status"] == 200 and _headers(head)[b"content-type"] == b"text/event-stream"
    assert _headers(head)[b"x-qosgate-class"] == b"api"
    assert [m["body"] for m in rec.sent[1:]] == [b": keep-alive\n\n", b": keep-alive\n\n",
                                                 b"data: 1\n\n", b"data: [DONE]\n\n"]
    assert sum(m["type"] == "http.response.start" for m in rec.sent) == 1


def test_an_error_after_the_early_head_is_an_event_and_done() -> None:
    rec = Recorder()
    sink = AsgiSink(rec)
    err = b'{"error":{"message":"m","type":"timeout_error","param":null,"code":"queue_timeout"}}'

    async def go() -> None:
        sink.keepalive(asyncio.get_running_loop())
        await asyncio.sleep(0)
        await sink.whole(504, err, [(b"content-type", b"application/json")])

    asyncio.run(go())
    assert rec.sent[-1]["body"] == b"data: " + err + b"\n\ndata: [DONE]\n\n"
    assert not rec.sent[-1]["more_body"] and sink.complete


# ---------------------------------------------------------------------- metrics and messages
def test_tenant_labels_beyond_the_cap_are_other() -> None:
    cfg = default_config(tenants=[{"name": f"t{i}", "api_keys": [f"k{i}"]} for i in range(5)])
    sched = Scheduler(cfg, None, [])
    m = GatewayMetrics(sched, lambda: 0.0)
    m.cap_tenants(2)
    for i in range(5):
        m.refused("none", f"t{i}", "invalid_json")
    m.refused("none", "unknown", "invalid_api_key")
    text = m.render().decode()
    tenants = {part.split('tenant="')[1].split('"')[0] for part in text.splitlines()
               if part.startswith("qosgate_requests_total{")}
    assert tenants == {"t0", "t1", "other", "unknown"}
    assert 'reason="invalid_json",tenant="other"} 3.0' in text


def test_limit_refusals_say_the_limit() -> None:
    cfg = default_config(tenants=[{"name": "t", "api_keys": ["k"],
                                   "limits": {"requests_per_minute": 1}}])
    sched = Scheduler(cfg, None, [])
    first = sched.make_request("a", QosInputs(api_key="k"), 0.0, 10, 10)
    sched.submit(first, 0.0)
    second = sched.make_request("b", QosInputs(api_key="k"), 0.0, 10, 10)
    sched.submit(second, 0.0)
    status, body, headers = outcome_error(second, cfg)
    msg = json.loads(body)["error"]["message"]
    assert status == 429 and "1 requests per minute" in msg and "token bucket" in msg
    assert headers and headers[0][0] == b"retry-after"
