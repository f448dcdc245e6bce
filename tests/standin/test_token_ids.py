"""vLLM 0.32's ``return_token_ids`` on the stand-in, byte for byte where vLLM writes the
members (flag on: the ids; flag off: null), and prompts given as token ids."""

from __future__ import annotations

import json
from typing import Any

import pytest

from qosgate.models.filler import VOCAB, text_ids
from tests.support.standin import MODEL, Answer, post

MESSAGES = [{"role": "user", "content": "Say hello to the new colleague."}]
PROMPT = "Once upon a time"


def chat(stream: bool, flag: bool | None, max_tokens: int = 4) -> Answer:
    body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": max_tokens,
                            "stream": stream}
    if flag is not None:
        body["return_token_ids"] = flag
    return post("/v1/chat/completions", body)


def completion(stream: bool, flag: bool | None, prompt: Any = PROMPT,
               max_tokens: int = 3) -> Answer:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                            "stream": stream, "stream_options": {"include_usage": True}}
    if not stream:
        del body["stream_options"]
    if flag is not None:
        body["return_token_ids"] = flag
    return post("/v1/completions", body)


def head(answer: Answer, kind: str) -> bytes:
    """``data: {"id":...,"object":...,"created":...,"model":...`` of ``answer``'s chunks."""
    first = answer.chunks()[0]
    return (b'data: {"id":"%s","object":"%s","created":%d,"model":"%s"'
            % (first["id"].encode(), kind.encode(), first["created"], MODEL.encode()))


def ids_json(ids: list[int] | None) -> bytes:
    return json.dumps(ids, separators=(",", ":")).encode()


def word_of(token_id: int) -> str:
    return " " + VOCAB[token_id]


def check_token(text: str, ids: list[int] | None, flag: bool | None) -> None:
    """A token chunk's ids: its own (its text is its word) with the flag, else null."""
    if flag:
        assert ids is not None and len(ids) == 1 and text == word_of(ids[0])
    else:
        assert ids is None


@pytest.mark.parametrize("flag", [True, False, None])
def test_chat_stream_members(flag: bool | None) -> None:
    answer = chat(stream=True, flag=flag)
    assert answer.status == 200
    events = answer.events()
    chunks = answer.chunks()
    top = head(answer, "chat.completion.chunk")
    prompt = ids_json(list(text_ids(json.dumps(MESSAGES).encode())) if flag else None)
    assert events[0] == top + (
        b',"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
        b'"finish_reason":null}],"prompt_token_ids":' + prompt + b',"prompt_text":null}')
    tokens = [c for c in chunks if c["choices"] and "content" in c["choices"][0]["delta"]
              and c["choices"][0]["delta"].get("role") is None]
    assert len(tokens) == 4
    for event, chunk in zip(events[1:5], tokens, strict=True):
        choice = chunk["choices"][0]
        text = choice["delta"]["content"]
        ids = choice["token_ids"]
        assert event == top + (
            b',"choices":[{"index":0,"delta":{"content":' + json.dumps(text).encode()
            + b'},"logprobs":null,"finish_reason":null,"token_ids":' + ids_json(ids) + b'}]}')
        check_token(text, ids, flag)
    assert events[-1] == b"data: [DONE]"


@pytest.mark.parametrize("flag", [True, False, None])
def test_completions_stream_members(flag: bool | None) -> None:
    answer = completion(stream=True, flag=flag)
    assert answer.status == 200
    events = answer.events()
    top = head(answer, "text_completion")
    prompt = ids_json(list(text_ids(json.dumps(PROMPT).encode())) if flag else None)
    for n, (event, chunk) in enumerate(zip(events[:3], answer.chunks()[:3], strict=True)):
        choice = chunk["choices"][0]
        ids = choice["token_ids"]
        assert event == top + (
            b',"choices":[{"index":0,"text":' + json.dumps(choice["text"]).encode()
            + b',"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":'
            + (prompt if n == 0 else b"null") + b',"token_ids":' + ids_json(ids) + b'}]}')
        check_token(choice["text"], ids, flag)
    usage = answer.chunks()[-1]["usage"]
    assert usage["prompt_tokens"] == len(text_ids(json.dumps(PROMPT).encode()))
    assert events[-1] == b"data: [DONE]"


@pytest.mark.parametrize("flag", [True, False, None])
def test_chat_whole_members(flag: bool | None) -> None:
    answer = chat(stream=False, flag=flag)
    assert answer.status == 200
    body = answer.json()
    assert list(body) == ["id", "object", "created", "model", "choices", "usage",
                          "prompt_token_ids"]
    choice = body["choices"][0]
    assert list(choice) == ["index", "message", "logprobs", "finish_reason", "token_ids"]
    if flag:
        assert body["prompt_token_ids"] == list(text_ids(json.dumps(MESSAGES).encode()))
        assert len(choice["token_ids"]) == 4
        assert choice["message"]["content"] == "".join(map(word_of, choice["token_ids"]))
    else:
        assert body["prompt_token_ids"] is None and choice["token_ids"] is None


@pytest.mark.parametrize("flag", [True, False, None])
def test_completions_whole_members(flag: bool | None) -> None:
    answer = completion(stream=False, flag=flag)
    assert answer.status == 200
    body = answer.json()
    assert list(body) == ["id", "object", "created", "model", "choices", "usage"]
    choice = body["choices"][0]
    assert list(choice) == ["index", "text", "logprobs", "finish_reason", "token_ids",
                            "prompt_token_ids"]
    if flag:
        assert choice["prompt_token_ids"] == list(text_ids(json.dumps(PROMPT).encode()))
        assert len(choice["token_ids"]) == 3
        assert choice["text"] == "".join(map(word_of, choice["token_ids"]))
    else:
        assert choice["prompt_token_ids"] is None and choice["token_ids"] is None


@pytest.mark.parametrize("prompt", [[5, 17, 42, 99, 3], [[5, 17, 42, 99, 3]]])
def test_a_prompt_of_token_ids(prompt: Any) -> None:
    answer = completion(stream=True, flag=True, prompt=prompt)
    assert answer.status == 200
    chunks = answer.chunks()
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [5, 17, 42, 99, 3]
    assert chunks[-1]["usage"]["prompt_tokens"] == 5
    whole = completion(stream=False, flag=True, prompt=prompt).json()
    assert whole["choices"][0]["prompt_token_ids"] == [5, 17, 42, 99, 3]
    assert whole["usage"]["prompt_tokens"] == 5
