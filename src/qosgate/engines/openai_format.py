"""OpenAI response objects for engines that generate in-process (the gateway's in-process path and
the vLLM stand-in share this): ``chat.completion``, ``chat.completion.chunk`` and
``text_completion``, with ``usage``, ``finish_reason`` and the closing ``data: [DONE]``.

Per-token chunks are built from a precomputed prefix and suffix around the JSON-encoded text, so a
token costs one small encode and one concatenation.
"""

from __future__ import annotations

import time

import msgspec

from qosgate.engines.base import Route

DONE = b"data: [DONE]\n\n"
_enc = msgspec.json.Encoder().encode


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class Formatter:
    """Formats one response (streamed or whole) of ``route`` for request ``rid``."""

    __slots__ = ("_pre", "_suf", "created", "id", "include_usage", "model", "route")

    def __init__(
        self, route: Route, rid: str, model: str, include_usage: bool = False
    ) -> None:
        self.route = route
        self.id = ("chatcmpl-" if route == "chat" else "cmpl-") + rid
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        head = _enc(
            {
                "id": self.id,
                "object": "chat.completion.chunk" if route == "chat" else "text_completion",
                "created": self.created,
                "model": model,
            }
        )[:-1]
        if route == "chat":
            self._pre = b"data: " + head + b',"choices":[{"index":0,"delta":{"content":'
            self._suf = b'},"logprobs":null,"finish_reason":null}]}\n\n'
        else:
            self._pre = b"data: " + head + b',"choices":[{"index":0,"text":'
            self._suf = b',"logprobs":null,"finish_reason":null}]}\n\n'

    # ------------------------------------------------------------------ streaming
    def opening(self) -> bytes:
        """Sent with the first token: the assistant role delta (chat only)."""
        if self.route != "chat":
            return b""
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def token(self, text: str) -> bytes:
        return self._pre + _enc(text) + self._suf

    def closing(self, finish_reason: str, prompt: int, completion: int) -> bytes:
        """The finish chunk, the usage chunk if asked for, and ``[DONE]``."""
        if self.route == "chat":
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
        out = self._chunk(choice)
        if self.include_usage:
            out += b"data: " + _enc(
                {**self._head(), "choices": [], "usage": _usage(prompt, completion)}
            ) + b"\n\n"
        return out + DONE

    def error_event(self, message: str, type_: str, code: str | int) -> bytes:
        return b"data: " + _enc({"error": {"message": message, "type": type_, "code": code}}) + (
            b"\n\n"
        )

    # ------------------------------------------------------------------ whole responses
    def whole(self, text: str, finish_reason: str, prompt: int, completion: int) -> bytes:
        if self.route == "chat":
            choice: dict[str, object] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            obj = "text_completion"
        return _enc(
            {
                "id": self.id,
                "object": obj,
                "created": self.created,
                "model": self.model,
                "choices": [choice],
                "usage": _usage(prompt, completion),
            }
        )

    # ------------------------------------------------------------------ helpers
    def _head(self) -> dict[str, object]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.route == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
        }

    def _chunk(self, choice: dict[str, object]) -> bytes:
        return b"data: " + _enc({**self._head(), "choices": [choice]}) + b"\n\n"


def models_list(names: list[str], owned_by: str = "qosgate") -> dict[str, object]:
    now = int(time.time())
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": now, "owned_by": owned_by} for n in names],
    }


def error_body(message: str, type_: str, code: str | int | None) -> dict[str, object]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}
