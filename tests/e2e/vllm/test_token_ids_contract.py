"""``return_token_ids`` on the stand-in against vLLM 0.32: the members in the same places (the
ids with the flag, null without), and a greedy stream continued from the ids it delivered (a
``/v1/completions`` prompt of token ids) going on exactly as it would have.

Each test runs ``[vllm]`` and ``[standin]``; with ``QOSGATE_VLLM=0`` only ``[standin]``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.httpclient import http
from tests.support.processes import Server
from tests.support.vllm import MODEL

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


@pytest.fixture(params=["vllm", "standin"])
def engine(request: pytest.FixtureRequest) -> Server:
    name = "vllm_fcfs" if request.param == "vllm" else "standin_fcfs"
    server: Server = request.getfixturevalue(name)
    return server


def stream(engine: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    code, _, data = http("POST", engine.url + path, json.dumps(body).encode(),
                         {"Content-Type": "application/json"}, timeout=60)
    assert code == 200, data
    events = [e.removeprefix("data: ") for e in data.decode().split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def greedy(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "stream": True, "temperature": 0, "ignore_eos": True, **kw}


@pytest.mark.parametrize("flag", [True, False])
def test_chat_stream_members(engine: Server, flag: bool) -> None:
    chunks = stream(engine, "/v1/chat/completions", greedy(
        messages=[{"role": "user", "content": "Hi"}], max_tokens=3, return_token_ids=flag))
    role = chunks[0]
    assert list(role)[-3:] == ["choices", "prompt_token_ids", "prompt_text"]
    assert role["prompt_text"] is None
    assert isinstance(role["prompt_token_ids"], list) if flag else role["prompt_token_ids"] is None
    token = chunks[1]["choices"][0]
    assert list(token)[-1] == "token_ids"
    assert isinstance(token["token_ids"], list) if flag else token["token_ids"] is None


@pytest.mark.parametrize("flag", [True, False])
def test_completions_stream_members(engine: Server, flag: bool) -> None:
    chunks = stream(engine, "/v1/completions", greedy(
        prompt="The sea is", max_tokens=3, return_token_ids=flag))
    first, second = chunks[0]["choices"][0], chunks[1]["choices"][0]
    assert list(first)[-4:] == ["finish_reason", "stop_reason", "prompt_token_ids", "token_ids"]
    if flag:
        assert isinstance(first["prompt_token_ids"], list) and first["prompt_token_ids"]
        assert isinstance(first["token_ids"], list)
    else:
        assert first["prompt_token_ids"] is None and first["token_ids"] is None
    assert second["prompt_token_ids"] is None


def _ids(chunks: list[dict[str, Any]]) -> tuple[list[int], list[int], str]:
    prompt: list[int] = []
    ids: list[int] = []
    text = ""
    for chunk in chunks:
        for choice in chunk["choices"]:
            prompt = choice.get("prompt_token_ids") or prompt
            ids += choice.get("token_ids") or []
            text += choice.get("text") or ""
    return prompt, ids, text


def test_a_continuation_from_delivered_ids_is_exact(engine: Server) -> None:
    n, k = 8, 3
    whole = _ids(stream(engine, "/v1/completions", greedy(
        prompt="The sea is", max_tokens=n, return_token_ids=True)))
    head = _ids(stream(engine, "/v1/completions", greedy(
        prompt="The sea is", max_tokens=k, return_token_ids=True)))
    tail = _ids(stream(engine, "/v1/completions", greedy(
        prompt=head[0] + head[1], max_tokens=n - k, return_token_ids=True)))
    assert tail[0] == head[0] + head[1]
    assert head[1] + tail[1] == whole[1]
    assert head[2] + tail[2] == whole[2]
