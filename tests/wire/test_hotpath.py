"""The hot-path pieces without servers: partial parse, priority splice, polarity, error mapping."""

from __future__ import annotations

import json
import math

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.config import default_config
from qosgate.core import QosInputs, Scheduler, State
from qosgate.core.queueing.engine_order import order_value
from qosgate.server.errors import outcome_error
from qosgate.wire.parse import BadBody, estimate_prompt_tokens, parse_body
from qosgate.wire.splice import engine_priority, set_priority


def test_parse_reads_only_the_scheduler_fields() -> None:
    body = (
        b'{"model":"m","messages":[{"role":"user","content":"' + b"x" * 400 + b'"}],'
        b'"stream":true,"max_tokens":7,"priority":2,"task_type":"chat","tools":[{"a":1}],'
        b'"latency_budget_ms":250.5,"stream_options":{"include_usage":true}}'
    )
    b = parse_body(body)
    assert (b.model, b.stream, b.max_tokens, b.priority, b.task_type) == ("m", True, 7, 2, "chat")
    assert b.latency_budget_ms == 250.5
    assert b.stream_options is not None and b.stream_options.include_usage
    assert 100 <= estimate_prompt_tokens(b) <= 110  # chars/4 of the raw messages span


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b'{"model": ', "invalid_json"),
        (b"not json", "invalid_json"),
        (b"[1, 2]", "invalid_body"),
        (b'{"max_tokens": "10"}', "invalid_body"),
        (b'{"stream": "yes"}', "invalid_body"),
        (b'{"priority": 1.5}', "invalid_body"),
    ],
)
def test_parse_refuses_bad_json_and_types(body: bytes, code: str) -> None:
    with pytest.raises(BadBody) as exc:
        parse_body(body)
    assert exc.value.code == code


def test_priority_absent_is_inserted_and_every_other_byte_kept() -> None:
    body = b' {  "model" : "m",\n "messages": [] }'
    out = set_priority(body, 3, present=False)
    assert out == b' {"priority":3,  "model" : "m",\n "messages": [] }'
    assert set_priority(b"{}", 0, present=False) == b'{"priority":0}'
    assert set_priority(body, None, present=False) is body


def test_priority_present_is_replaced_in_place() -> None:
    body = b'{"model":"m", "priority" : -4 ,"x":"say \\"priority\\": 9"}'
    assert set_priority(body, 1, present=True) == (
        b'{"model":"m", "priority":1 ,"x":"say \\"priority\\": 9"}'
    )
    assert json.loads(set_priority(body, None, present=True)) == {
        "model": "m",
        "x": 'say "priority": 9',
    }


def test_priority_nested_elsewhere_takes_the_slow_path() -> None:
    body = b'{"tools":{"priority":5},"priority":2}'
    out = set_priority(body, 0, present=True)
    assert json.loads(out) == {"tools": {"priority": 5}, "priority": 0}
    assert json.loads(set_priority(body, None, present=True)) == {"tools": {"priority": 5}}


_json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids,
                                                                max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    obj=st.dictionaries(st.sampled_from(["priority", "x", "tools", "p", "content"]), _json_values),
    value=st.one_of(st.none(), st.integers(-3, 9)),
    indent=st.booleans(),
)
def test_splice_equals_setting_the_member(obj: dict[str, object], value: int | None,
                                          indent: bool) -> None:
    prio = obj.get("priority")
    if "priority" in obj and (isinstance(prio, bool) or not (prio is None
                                                             or isinstance(prio, int))):
        obj["priority"] = 1  # the parser only lets int/null through
    body = json.dumps(obj, indent=2 if indent else None).encode()
    present = parse_body(body).priority is not msgspec.UNSET
    out = json.loads(set_priority(body, value, present))
    expect = dict(obj)
    if value is None:
        expect.pop("priority", None)
    else:
        expect["priority"] = value
    assert out == expect


def test_polarity_follows_each_engine() -> None:
    # qosgate's order, smaller first: band, then the rank inside it
    orders = [order_value(b, r) for b in range(4) for r in (0, 7, 10**9, math.inf)]
    assert orders == sorted(orders) and len(set(orders)) == len(orders)
    # vLLM: smaller value runs first (as sent); SGLang (default): larger runs first
    assert [engine_priority("vllm", o, 4) for o in orders] == orders
    sglang = [engine_priority("sglang", o, 4) for o in orders]
    assert sglang == sorted(sglang, reverse=True) and min(v for v in sglang if v is not None) >= 0
    assert all(v is not None and v < 2**53 for v in sglang)  # exact as a JSON double, too
    assert engine_priority("none", orders[5], 4) is None
    # the band alone, for whatever reads it as a small class number
    assert [engine_priority("vllm", order_value(b, 99), 4, "class") for b in range(4)] == [0, 1,
                                                                                         2, 3]
    assert [engine_priority("sglang", order_value(b, 99), 4, "class") for b in range(4)] == [
        3, 2, 1, 0]


def test_outcome_statuses_and_retry_after() -> None:
    sched = Scheduler(default_config())
    req = sched.make_request("r1", QosInputs(), 0.0, 10, 10)
    req.move(State.REJECTED, "rate_limit_requests")
    req.retry_after = 2.2
    status, body, headers = outcome_error(req)
    # whole seconds rounded up, and the milliseconds the openai SDK reads first
    assert status == 429 and headers == [(b"retry-after", b"3"), (b"retry-after-ms", b"2200")]
    assert json.loads(body)["error"]["code"] == "rate_limit_requests"
    for reason, expect in [("prompt_too_long", 400), ("deadline_infeasible", 503),
                           ("displaced", 503), ("invalid_max_tokens", 400)]:
        r = sched.make_request(reason, QosInputs(), 0.0, 10, 10)
        r.move(State.REJECTED, reason)
        assert outcome_error(r)[0] == expect
    t = sched.make_request("t", QosInputs(), 0.0, 10, 10)
    t.move(State.QUEUED)
    t.move(State.TIMED_OUT, "queue_timeout")
    assert outcome_error(t)[0] == 504
