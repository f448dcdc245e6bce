"""Unservable bodies on the embedded llama.cpp engine: what the model cannot do is a 400 naming the
member (tools, functions, logprobs, top_logprobs), and text that is not UTF-8 never reaches the
tokenizer; both refused before admission and counted once."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.httpclient import http
from tests.support.llama import MODEL, Serve

pytestmark = pytest.mark.e2e

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Serve]:
    s = Serve(tmp_path_factory.mktemp("abuse") / "serve.log")
    yield s
    assert s.stop() == 0


def refused(serve: Serve, reason: str) -> float:
    with urllib.request.urlopen(serve.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("qosgate_requests_total{") and f'reason="{reason}"' in line
               and 'class="none"' in line)


@pytest.mark.parametrize(
    ("route", "extra", "param"),
    [
        ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
         "tools"),
        ("chat", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ("chat", {"logprobs": True}, "logprobs"),
        ("chat", {"logprobs": True, "top_logprobs": 2}, "logprobs"),
        ("chat", {"top_logprobs": 3}, "top_logprobs"),
        ("completions", {"logprobs": 2}, "logprobs"),
    ],
)
def test_unsupported_members_are_400_naming_them(serve: Serve, route: str, extra: dict[str, Any],
                                                 param: str) -> None:
    before = refused(serve, "invalid_body")
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, **extra}
    if route == "chat":
        body["messages"] = HI
        path = "/v1/chat/completions"
    else:
        body["prompt"] = "hi"
        path = "/v1/completions"
    code, _, out = http("POST", serve.url + path, json.dumps(body).encode())
    err = json.loads(out)["error"]
    assert code == 400 and err["param"] == param and err["type"] == "invalid_request_error"
    assert refused(serve, "invalid_body") == before + 1


def test_what_asks_for_nothing_is_served(serve: Serve) -> None:
    body = {"model": MODEL, "max_tokens": 2, "messages": HI, "tools": [], "logprobs": False,
            "top_logprobs": None}
    code, _, out = http("POST", serve.url + "/v1/chat/completions", json.dumps(body).encode(),
                        timeout=120)  # a model on a shared CPU
    assert code == 200, out


def test_invalid_utf8_in_message_text_is_a_counted_400(serve: Serve) -> None:
    before = refused(serve, "invalid_utf8")
    body = b'{"max_tokens":2,"messages":[{"role":"user","content":"caf\xe9 \xff"}]}'
    code, _, out = http("POST", serve.url + "/v1/chat/completions", body)
    assert code == 400 and json.loads(out)["error"]["code"] == "invalid_utf8"
    assert refused(serve, "invalid_utf8") == before + 1
    code, _, _ = http("POST", serve.url + "/v1/chat/completions",
                      json.dumps({"max_tokens": 2, "messages": HI}).encode(), timeout=120)
    assert code == 200
