"""The continuation of a stream: which bodies continue exactly, the continuation's body, and the
transcript that passes the first call's events (ids written ``null`` unless asked for) and
rewrites a continuation's completions chunks in the first answer's format, as vLLM 0.32 writes
them (the shapes below are captured from it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qosgate.wire.resume import MEMBERS, Transcript, blocker, continuation, transcript_for

HEAD = b'"id":"chatcmpl-1","object":"chat.completion.chunk","created":7,"model":"m"'
CHAT = [
    b'data: {' + HEAD + b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
    b'"logprobs":null,"finish_reason":null}],"prompt_token_ids":[1,2,3],"prompt_text":null}\n\n',
    b'data: {' + HEAD + b',"choices":[{"index":0,"delta":{"content":"Hello"},"logprobs":null,'
    b'"finish_reason":null,"token_ids":[19556]}]}\n\n',
    b'data: {' + HEAD + b',"choices":[{"index":0,"delta":{"content":" there"},"logprobs":null,'
    b'"finish_reason":null,"token_ids":[665]}]}\n\n',
]


def _cont(text: str, ids: list[int], finish: str | None = None) -> bytes:
    c = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
         "stop_reason": None, "prompt_token_ids": None, "token_ids": ids}
    return b"data: " + json.dumps({"id": "cmpl-x-1", "object": "text_completion",
                                   "created": 9, "model": "m", "choices": [c]},
                                  separators=(",", ":")).encode() + b"\n\n"


USAGE = (b'data: {"id":"cmpl-x-1","object":"text_completion","created":9,"model":"m",'
         b'"choices":[],"usage":{"prompt_tokens":5,"total_tokens":7,"completion_tokens":2},'
         b'"system_fingerprint":"vllm-0.32.0-f"}\n\n')


@pytest.mark.parametrize(("body", "why"), [
    (b'{"model":"m","messages":[],"stream":true,"temperature":0}', None),
    (b'{"model":"m","prompt":"x","stream":true,"seed":3,"temperature":0}', None),
    (b'{"model":"m","prompt":"x","stream":true,"seed":3}', "`seed`"),
    (b'{"model":"m","prompt":"x","stream":true,"n":1,"stop":null,"tools":[]}', None),
    (b'{"model":"m","prompt":"x","stream":true,"n":2}', "`n`"),
    (b'{"model":"m","prompt":"x","stream":true,"stop":["\\n"]}', "`stop`"),
    (b'{"model":"m","prompt":"x","stream":true,"frequency_penalty":0.5}', "`frequency_penalty`"),
    (b'{"model":"m","prompt":"x","stream":true,"logprobs":true}', "`logprobs`"),
    (b'{"model":"m","prompt":"x","stream":true,"response_format":{"type":"json_object"}}',
     "`response_format`"),
    (b'{"model":"m","prompt":"x","stream":true,"response_format":{"type":"text"}}', None),
    (b'{"model":"m","prompt":"x","stream":true,"tool_choice":"none"}', None),
    (b'{"model":"m","prompt":"x","stream":true,"something_new":1}', "`something_new`"),
    (b'{"model":"m","prompt":"x"}', "a whole answer"),
    (b'{"model":"m","prompt":["a","b"],"stream":true}', "several prompts"),
    (b'{"model":"m","prompt":[[1,2],[3]],"stream":true}', "several prompts"),
    (b'{"model":"m","prompt":[1,2,3],"stream":true}', None),
    (b'{"model":"m","prompt":["a"],"stream":true}', None),
    (b'{"model":"m","prompt":"x","stream":true,"stream_options":{"include_usage":true,'
     b'"continuous_usage_stats": true}}', "continuous_usage_stats"),
])
def test_what_continues_exactly(body: bytes, why: str | None) -> None:
    stream = b'"stream":true' in body
    got = blocker("completions", stream, body)
    assert (got is None) if why is None else (got is not None and why in got)


def test_the_responses_api_and_embeddings_are_not_continued() -> None:
    assert blocker("responses", True, b'{"input":"x","stream":true}') is not None
    assert blocker("embeddings", True, b"{}") is not None


def test_every_member_has_a_rule_and_a_note() -> None:
    for name, (rule, note, _) in MEMBERS.items():
        assert rule in ("carried", "rendered", "adjusted", "ignored", "blocks"), name
        assert note, name


def test_the_continuation_body_carries_sampling_and_the_rest_of_the_cap() -> None:
    body = (b'{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":0,'
            b'"top_k":5,"min_tokens":10,"max_tokens":40,"stream":true,"user":"u",'
            b'"stream_options":{"include_usage":false},"metadata":{"a":"b"}}')
    got = json.loads(continuation(body, [1, 2], [7, 8, 9], 40))
    assert got == {"model": "m", "temperature": 0, "top_k": 5, "user": "u",
                   "prompt": [1, 2, 7, 8, 9], "max_tokens": 37, "min_tokens": 7,
                   "stream": True, "stream_options": {"include_usage": True},
                   "return_token_ids": True}


def test_the_first_call_asks_for_ids_and_passes_with_them_null() -> None:
    tr = transcript_for("chat", True, b'{"model":"m","messages":[],"stream":true}', False)
    assert tr is not None
    assert tr.engine_body(b'{"model":"m","stream":true}') == (
        b'{"return_token_ids":true,"model":"m","stream":true}')
    out = tr.feed(b"".join(CHAT)[:-30]) + tr.feed(b"".join(CHAT)[-30:])
    assert out == b"".join(CHAT).replace(b'"prompt_token_ids":[1,2,3]', b'"prompt_token_ids":null'
                                         ).replace(b"[19556]", b"null").replace(b"[665]", b"null")
    assert tr.prompt_ids == [1, 2, 3] and tr.ids == [19556, 665] and tr.continuable


def test_a_client_that_asked_for_ids_gets_them() -> None:
    tr = transcript_for("chat", True, b'{"stream":true,"return_token_ids":true}', False)
    assert tr is not None and tr.wants_ids
    assert tr.engine_body(b'{"stream":true,"return_token_ids":true}') == (
        b'{"stream":true,"return_token_ids":true}')
    assert tr.feed(b"".join(CHAT)) == b"".join(CHAT)


def test_an_event_split_between_reads_waits_for_its_end() -> None:
    tr = Transcript("chat", False, False)
    assert tr.feed(CHAT[0][:10]) == b""
    assert tr.feed(CHAT[0][10:]).startswith(b"data: {" + HEAD)


def test_a_continuation_is_written_as_the_first_answer_with_usage() -> None:
    tr = Transcript("chat", False, True)
    tr.feed(b"".join(CHAT))
    tr.next_segment()
    out = tr.feed(_cont(" world", [11]) + _cont("!", [12], "length") + USAGE + b"data: [DONE]\n\n")
    assert out == (
        b'data: {' + HEAD + b',"choices":[{"index":0,"delta":{"content":" world"},'
        b'"logprobs":null,"finish_reason":null,"token_ids":null}]}\n\n'
        b'data: {' + HEAD + b',"choices":[{"index":0,"delta":{"content":"!"},'
        b'"logprobs":null,"finish_reason":"length","stop_reason":null,"token_ids":null}]}\n\n'
        b'data: {' + HEAD + b',"choices":[],"usage":{"prompt_tokens":3,"total_tokens":7,'
        b'"completion_tokens":4},"system_fingerprint":"vllm-0.32.0-f"}\n\n'
        b"data: [DONE]\n\n")
    assert tr.ids == [19556, 665, 11, 12] and tr.ended and not tr.continuable


def test_without_usage_the_fingerprint_ends_the_finish_event() -> None:
    tr = Transcript("completions", False, False)
    head = b'"id":"cmpl-1","object":"text_completion","created":7,"model":"m"'
    tr.feed(b'data: {' + head + b',"choices":[{"index":0,"text":"a","logprobs":null,'
            b'"finish_reason":null,"stop_reason":null,"prompt_token_ids":[4],'
            b'"token_ids":[5]}]}\n\n')
    tr.next_segment()
    out = tr.feed(_cont(" b", [6], "length") + USAGE + b"data: [DONE]\n\n")
    assert out == (
        b'data: {' + head + b',"choices":[{"index":0,"text":" b","logprobs":null,'
        b'"finish_reason":"length","stop_reason":null,"prompt_token_ids":null,'
        b'"token_ids":null}],"system_fingerprint":"vllm-0.32.0-f"}\n\n'
        b"data: [DONE]\n\n")


@pytest.mark.parametrize("event", [
    # a reasoning delta: a completions continuation could not write it
    b'data: {' + HEAD + b',"choices":[{"index":0,"delta":{"reasoning_content":"hm"},'
    b'"logprobs":null,"finish_reason":null,"token_ids":[4]}]}\n\n',
    # the engine returned no ids
    b'data: {' + HEAD + b',"choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,'
    b'"finish_reason":null,"token_ids":null}]}\n\n',
    b'data: {' + HEAD + b',"choices":[{"index":0,"delta":{"content":"x"},"logprobs":null,'
    b'"finish_reason":null}]}\n\n',
])
def test_what_a_continuation_cannot_reproduce_is_never_continued(event: bytes) -> None:
    tr = Transcript("chat", False, False)
    tr.feed(CHAT[0])
    assert tr.continuable
    tr.feed(event)
    assert not tr.exact and not tr.continuable


DOC = Path(__file__).resolve().parents[2] / "docs" / "guides" / "scheduling.md"
ROW = re.compile(r"^\| ((?:`[^`]+`(?:, )?)+) \| (carried|rendered|adjusted|ignored|blocks) \|",
                 re.M)


def test_the_guide_lists_every_member_with_its_rule() -> None:
    text = DOC.read_text()
    table = text[text.index("<!-- resume-members"):]
    documented: dict[str, str] = {}
    for names, rule in ROW.findall(table):
        for name in re.findall(r"`([^`]+)`", names):
            assert name not in documented, f"{name} is twice in the table"
            documented[name] = rule
    assert documented == {name: rule for name, (rule, _, _) in MEMBERS.items()}
