#!/usr/bin/env python3
"""Capture a real vLLM's whole and streamed answers to the same requests, for
``tests/wire/test_assemble.py`` (its ``data/vllm032/``).

Each case is sent twice: as is (the whole answer, ``NAME.json``) and with ``"stream": true`` and
``stream_options.include_usage`` (the raw event stream, ``NAME.sse``); the request is kept beside
them (``NAME.request.json``). The tool-call cases need a vLLM started with a tool parser:

    python scripts/vllm_env.py serve --port 8001 --max-num-seqs 2 -- \\
        --enable-auto-tool-choice --tool-call-parser hermes
    python scripts/capture_vllm_streams.py 8001 tests/wire/data/vllm032
"""

from __future__ import annotations

import http.client
import json
import sys
from pathlib import Path
from typing import Any

MODEL = "smollm2-135m-instruct"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
SYSTEM = [{"role": "system", "content": 'You call tools. Reply only with <tool_call>{"name": ..., '
                                        '"arguments": {...}}</tool_call>.'}]
WEATHER = [*SYSTEM, {"role": "user", "content": "What is the weather in Paris? Use get_weather."}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "chat_logprobs_n2": (CHAT, {
        "model": MODEL, "messages": [{"role": "user", "content": "Say hello in French."}],
        "max_tokens": 6, "temperature": 0.7, "seed": 11, "n": 2, "logprobs": True,
        "top_logprobs": 2}),
    "chat_stop": (CHAT, {
        "model": MODEL, "messages": [{"role": "user", "content": "Count: one, two, three, four"}],
        "max_tokens": 12, "temperature": 0, "stop": ["Three"]}),
    "chat_tool_named": (CHAT, {
        "model": MODEL, "messages": WEATHER, "max_tokens": 120, "temperature": 0, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
    "chat_tool_required": (CHAT, {
        "model": MODEL, "messages": WEATHER, "max_tokens": 120, "temperature": 0, "tools": TOOLS,
        "tool_choice": "required"}),
    "completions_logprobs_n2": (COMPLETIONS, {
        "model": MODEL, "prompt": "The capital of France is", "max_tokens": 5,
        "temperature": 0.7, "seed": 5, "n": 2, "logprobs": 2}),
    "completions_plain": (COMPLETIONS, {
        "model": MODEL, "prompt": "Once upon a time", "max_tokens": 7, "temperature": 0}),
}


def post(port: int, path: str, body: dict[str, Any]) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def main(argv: list[str]) -> int:
    port, out = int(argv[0]), Path(argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, (path, body) in CASES.items():
        for streamed in (False, True):
            sent = {**body, "stream": True, "stream_options": {"include_usage": True}} if (
                streamed) else body
            status, data = post(port, path, sent)
            print(name, "stream" if streamed else "whole", status, len(data))
            if status != 200:
                return 1
            (out / f"{name}.{'sse' if streamed else 'json'}").write_bytes(data)
        (out / f"{name}.request.json").write_text(json.dumps({"path": path, "body": body}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
