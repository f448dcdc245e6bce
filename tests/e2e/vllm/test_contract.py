"""The stand-in against the real thing: the same requests straight to vLLM 0.32 (fcfs) and to
``qosgate.standin.server`` (fcfs), the same answers expected from both.

Each test runs twice, ``[vllm]`` and ``[standin]``; a difference found here is fixed in the
stand-in (its docstring lists what it mirrors). With ``QOSGATE_VLLM=0`` only ``[standin]`` runs.
"""

from __future__ import annotations

import json
import time
from http.client import HTTPConnection
from typing import Any

import pytest

from qosgate.wire.engine_metrics import parse_engine_metrics
from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import Server
from tests.support.vllm import MAX_MODEL_LEN, MODEL
from tests.support.waiting import wait_until

# the first test here may build the environment and start vLLM (minutes on a busy machine)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


@pytest.fixture(params=["vllm", "standin"])
def engine(request: pytest.FixtureRequest) -> Server:
    name = "vllm_fcfs" if request.param == "vllm" else "standin_fcfs"
    server: Server = request.getfixturevalue(name)
    return server


def post(engine: Server, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    code, _, data = http("POST", engine.url + path, json.dumps(body).encode(),
                         {"Content-Type": "application/json"}, timeout=60)
    return code, json.loads(data)


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "The sea is", "max_tokens": 4, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
            **kw}


@pytest.mark.parametrize("priority", [3, 1, -7])
def test_fcfs_accepts_a_nonzero_priority_and_ignores_it(engine: Server, priority: int) -> None:
    code, body = post(engine, "/v1/completions", completion(priority=priority))
    assert code == 200, body
    assert body["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("value", ["high", None, 2.5])
def test_a_priority_that_is_not_an_integer_is_a_400(engine: Server, value: object) -> None:
    code, body = post(engine, "/v1/completions", completion(priority=value))
    assert code == 400
    err = body["error"]
    assert (err["type"], err["param"], err["code"]) == ("Bad Request", "body.priority", 400)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
@pytest.mark.parametrize("stream", [False, True])
def test_max_tokens_over_max_model_len(engine: Server, field: str, stream: bool) -> None:
    asked = MAX_MODEL_LEN + 952
    req = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], field: asked,
           "stream": stream}
    code, body = post(engine, "/v1/chat/completions", req)
    assert code == 400
    assert body == {
        "error": {
            "message": f"{field}={asked} cannot be greater than max_model_len={MAX_MODEL_LEN}. "
            f"Please request fewer output tokens. (parameter={field}, value={asked})",
            "type": "BadRequestError",
            "param": field,
            "code": 400,
        }
    }


@pytest.mark.parametrize("value", [0, -1])
def test_max_tokens_below_one(engine: Server, value: int) -> None:
    code, body = post(engine, "/v1/completions", completion(max_tokens=value))
    assert code == 400
    assert body["error"] == {
        "message": f"max_tokens must be at least 1, got {value}. "
        f"(parameter=max_tokens, value={value})",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }


def test_unknown_model_is_a_404(engine: Server) -> None:
    code, body = post(engine, "/v1/chat/completions", chat(model="nope"))
    assert code == 404
    assert body == {
        "error": {
            "message": f"The model `nope` does not exist. Valid aliases: {MODEL}.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_no_model_means_the_served_one(engine: Server) -> None:
    code, body = post(engine, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert code == 200 and body["model"] == MODEL


def test_models(engine: Server) -> None:
    code, _, data = http("GET", engine.url + "/v1/models")
    doc = json.loads(data)
    assert code == 200 and doc["object"] == "list" and len(doc["data"]) == 1
    card = doc["data"][0]
    assert list(card) == ["id", "object", "created", "owned_by", "root", "parent",
                          "max_model_len", "permission"]
    assert (card["id"], card["object"], card["owned_by"], card["parent"]) == (
        MODEL, "model", "vllm", None)
    assert card["max_model_len"] == MAX_MODEL_LEN and isinstance(card["root"], str)
    assert [p["object"] for p in card["permission"]] == ["model_permission"]


def test_no_max_tokens(engine: Server) -> None:
    """vLLM's own defaults: chat runs to the end of the context, completions stop at 16 (the
    legacy completions API's default)."""
    code, body = post(engine, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "the " * 1700}],
        "ignore_eos": True})
    assert code == 200, body
    u = body["usage"]
    assert u["prompt_tokens"] + u["completion_tokens"] == MAX_MODEL_LEN
    assert body["choices"][0]["finish_reason"] == "length"
    code, body = post(engine, "/v1/completions", {"model": MODEL, "prompt": "The sea is",
                                                   "ignore_eos": True})
    assert code == 200, body
    assert body["usage"]["completion_tokens"] == 16
    assert body["choices"][0]["finish_reason"] == "length"


def test_unknown_path(engine: Server) -> None:
    code, _, body = http("GET", engine.url + "/v1/nothing")
    assert (code, json.loads(body)) == (404, {"detail": "Not Found"})
    assert http("GET", engine.url + "/health")[0] == 200


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_whole_response_and_usage(engine: Server, route: str) -> None:
    req = chat(ignore_eos=True) if route == "chat" else completion(ignore_eos=True)
    code, body = post(engine, f"/v1/{'chat/' if route == 'chat' else ''}completions", req)
    assert code == 200
    assert body["object"] == ("chat.completion" if route == "chat" else "text_completion")
    assert body["id"].startswith("chatcmpl-" if route == "chat" else "cmpl-")
    assert body["model"] == MODEL
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    if route == "chat":
        assert choice["message"]["role"] == "assistant"
        assert isinstance(choice["message"]["content"], str)
    else:
        assert isinstance(choice["text"], str)
    u = body["usage"]
    assert u["completion_tokens"] == 4 and u["prompt_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]


def sse(engine: Server, path: str, body: dict[str, Any]) -> list[Any]:
    code, headers, data = http("POST", engine.url + path, json.dumps(body).encode(),
                               {"Content-Type": "application/json"}, timeout=60)
    assert code == 200 and headers["content-type"].startswith("text/event-stream")
    events = [e.removeprefix("data: ") for e in data.decode().split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_stream_with_usage(engine: Server, route: str) -> None:
    req = (chat if route == "chat" else completion)(
        ignore_eos=True, stream=True, stream_options={"include_usage": True}
    )
    events = sse(engine, f"/v1/{'chat/' if route == 'chat' else ''}completions", req)
    *chunks, last = events
    assert last["choices"] == []
    assert last["usage"]["completion_tokens"] == 4
    kind = "chat.completion.chunk" if route == "chat" else "text_completion"
    assert all(c["object"] == kind and c["model"] == MODEL for c in events)
    assert len({c["id"] for c in events}) == 1
    reasons = [c["choices"][0]["finish_reason"] for c in chunks]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    if route == "chat":
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"


def test_metric_names_labels_and_units(engine: Server) -> None:
    post(engine, "/v1/completions", completion())
    _, _, raw = http("GET", engine.url + "/metrics")
    text = raw.decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
        values = metric_values(text, name)
        assert values, name
        for labels in values:
            assert dict(labels) == {"engine": "0", "model_name": MODEL}, (name, labels)
    reasons = {dict(k)["finished_reason"]
               for k in metric_values(text, "vllm:request_success_total")}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}
    s = parse_engine_metrics(text, 0.0, engine="vllm")
    assert s.kv_usage is not None and 0.0 <= s.kv_usage <= 1.0  # a fraction
    assert s.running is not None and s.waiting is not None and s.preemptions_total is not None
    # the inter-token latency histogram (the TPOT guard's reading): the 4-token completion's
    # 3 gaps after its first token at least, in seconds
    for suffix in ("_sum", "_count"):
        assert metric_values(text, "vllm:inter_token_latency_seconds" + suffix), suffix
    assert s.itl_tokens_total is not None and s.itl_tokens_total >= 3
    assert s.itl_seconds_total is not None and s.itl_seconds_total > 0


def test_a_client_abort_is_not_counted_in_request_success(engine: Server) -> None:
    """vLLM 0.32 stops a request whose client left, but counts only what the engine finishes:
    ``finished_reason="abort"`` does not move (the stand-in mirrors that)."""

    def aborted() -> float:
        _, _, raw = http("GET", engine.url + "/metrics")
        values = metric_values(raw.decode(), "vllm:request_success_total")
        return sum(v for k, v in values.items() if dict(k)["finished_reason"] == "abort")

    def running() -> int | None:
        _, _, raw = http("GET", engine.url + "/metrics")
        return parse_engine_metrics(raw.decode(), 0.0, engine="vllm").running

    assert wait_until(lambda: running() == 0, 60)
    before = aborted()
    conn = HTTPConnection("127.0.0.1", engine.port, timeout=60)
    body = completion(max_tokens=MAX_MODEL_LEN - 16, ignore_eos=True, stream=True)
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # it is generating
    assert wait_until(lambda: running() == 1, 10)
    conn.close()  # the client leaves
    t = time.monotonic()
    assert wait_until(lambda: running() == 0, 30), "the engine did not stop the request"
    assert time.monotonic() - t < 30
    assert aborted() == before


# the Responses API as vLLM 0.32 answers it (stream: each event's type and members, in order)
RESPONSE_MEMBERS = [
    "id", "created_at", "incomplete_details", "instructions", "metadata", "model", "object",
    "output", "parallel_tool_calls", "temperature", "tool_choice", "tools", "top_p",
    "background", "max_output_tokens", "max_tool_calls", "previous_response_id", "prompt",
    "reasoning", "service_tier", "status", "text", "top_logprobs", "truncation", "usage", "user",
    "presence_penalty", "frequency_penalty", "kv_transfer_params", "ec_transfer_params",
    "input_messages", "output_messages"]
RESPONSE_EVENTS = [
    ("response.created", ["response", "sequence_number", "type"]),
    ("response.in_progress", ["response", "sequence_number", "type"]),
    ("response.output_item.added", ["item", "output_index", "sequence_number", "type"]),
    ("response.content_part.added",
     ["content_index", "item_id", "output_index", "part", "sequence_number", "type"]),
    ("response.output_text.delta", ["content_index", "delta", "item_id", "logprobs",
                                    "output_index", "sequence_number", "type"]),
    ("response.output_text.delta", ["content_index", "delta", "item_id", "logprobs",
                                    "output_index", "sequence_number", "type"]),
    ("response.output_text.done", ["content_index", "item_id", "logprobs", "output_index",
                                   "sequence_number", "text", "type"]),
    ("response.content_part.done",
     ["content_index", "item_id", "output_index", "part", "sequence_number", "type"]),
    ("response.output_item.done", ["item", "output_index", "sequence_number", "type"]),
    ("response.completed", ["response", "sequence_number", "type"]),
]


@pytest.mark.parametrize("stream", [False, True])
def test_responses_api(engine: Server, stream: bool) -> None:
    body = {"model": MODEL, "input": "Say hi", "max_output_tokens": 2, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    code, headers, data = http("POST", engine.url + "/v1/responses", json.dumps(body).encode(),
                               {"Content-Type": "application/json"}, timeout=60)
    assert code == 200, data
    if stream:
        assert headers["content-type"].startswith("text/event-stream")
        lines = data.decode().split("\n")
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
        named = [line[7:] for line in lines if line.startswith("event: ")]
        assert [(e["type"], list(e)) for e in events] == RESPONSE_EVENTS
        assert named == [e["type"] for e in events]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        doc = events[-1]["response"]
        assert "".join(e["delta"] for e in events if "delta" in e) == (
            doc["output"][0]["content"][0]["text"])
    else:
        doc = json.loads(data)
    assert list(doc) == RESPONSE_MEMBERS
    assert doc["status"] == "incomplete"
    assert doc["incomplete_details"] == {"reason": "max_output_tokens"}
    assert doc["usage"]["output_tokens"] == 2
    assert doc["max_output_tokens"] == 2 and doc["temperature"] == 0
