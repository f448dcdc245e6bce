"""The Responses API's answers (``/v1/responses``) as vLLM 0.32 writes them, for the vLLM
stand-in: a ``response`` object whole, or its events streamed (``event: <type>`` then its
``data:``), with the same interface as ``answers.Formatter`` (``opening``, ``token``,
``closing``, ``whole``) so that the engines that write chat and completions write these too.

The shapes, member for member, are those a real vLLM 0.32 answered for SmolLM2 (a message
with one ``output_text`` part; ``status`` ``incomplete`` with ``incomplete_details.reason``
``max_output_tokens`` when the cap ended it); ``tests/e2e/vllm/test_contract.py`` compares
them with vLLM's.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from qosgate.wire import sse

_enc = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder(dict[str, Any]).decode
_ECHOED = ("instructions", "metadata", "temperature", "top_p", "max_output_tokens", "user")


class ResponsesFormatter:
    """Formats one Responses API answer (streamed or whole) for request ``rid``."""

    __slots__ = ("created", "echo", "id", "item", "model", "seq", "texts")

    def __init__(self, rid: str, model: str, body: bytes = b"{}") -> None:
        self.id = "resp_" + rid
        self.item = "msg_" + rid
        self.model = model
        self.created = int(time.time())
        # the request's own members its response repeats, as vLLM's does
        try:
            asked = _decode(body)
        except msgspec.DecodeError:
            asked = {}
        self.echo = {k: asked[k] for k in _ECHOED if k in asked}
        for k in ("temperature", "top_p"):  # vLLM writes them as floats
            if isinstance(self.echo.get(k), int):
                self.echo[k] = float(self.echo[k])
        self.seq = 0
        self.texts: list[str] = []

    # ------------------------------------------------------------------ streaming
    def opening(self) -> bytes:
        return (self._event("response.created", response=self._response("in_progress"))
                + self._event("response.in_progress", response=self._response("in_progress"))
                + self._event("response.output_item.added", item=self._message("in_progress"),
                              output_index=0)
                + self._event("response.content_part.added", content_index=0,
                              item_id=self.item, output_index=0, part=self._part("", [])))

    def token(self, text: str) -> bytes:
        self.texts.append(text)
        return self._event("response.output_text.delta", content_index=0, delta=text,
                           item_id=self.item, logprobs=[], output_index=0)

    def closing(self, finish_reason: str, prompt: int, completion: int,
                cached: int | None = None) -> bytes:
        text = "".join(self.texts)
        done = self._response_done(text, finish_reason, prompt, completion, cached)
        return (self._event("response.output_text.done", content_index=0, item_id=self.item,
                            logprobs=[], output_index=0, text=text)
                + self._event("response.content_part.done", content_index=0,
                              item_id=self.item, output_index=0, part=self._part(text, None))
                + self._event("response.output_item.done",
                              item=self._message("completed", text), output_index=0)
                + self._event("response.completed", response=done))

    def error_event(self, message: str, type_: str, code: str | int) -> bytes:
        return sse.error_event(message, type_, code)

    # ------------------------------------------------------------------ whole
    def whole(self, text: str, finish_reason: str, prompt: int, completion: int,
              cached: int | None = None) -> bytes:
        return _enc(self._response_done(text, finish_reason, prompt, completion, cached))

    # ------------------------------------------------------------------ parts
    def _event(self, type_: str, **members: Any) -> bytes:
        # an event's members in vLLM's order: by name (its event models declare them so)
        doc = dict(sorted({**members, "sequence_number": self.seq, "type": type_}.items()))
        self.seq += 1
        return b"event: " + type_.encode() + b"\n" + sse.json_event(_enc(doc))

    def _part(self, text: str, logprobs: list[Any] | None) -> dict[str, Any]:
        return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}

    def _message(self, status: str, text: str | None = None) -> dict[str, Any]:
        content = [] if text is None else [self._part(text, None)]
        return {"id": self.item, "content": content, "role": "assistant", "status": status,
                "type": "message", "phase": None}

    def _response_done(self, text: str, finish_reason: str, prompt: int, completion: int,
                       cached: int | None) -> dict[str, Any]:
        capped = finish_reason == "length"
        usage = {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached or 0, "cache_write_tokens": 0,
                                     "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0, "tool_output_tokens": 0,
                                      "output_tokens_per_turn": [],
                                      "tool_output_tokens_per_turn": []},
            "total_tokens": prompt + completion,
        }
        return self._response("incomplete" if capped else "completed",
                              [self._message("completed", text)], usage,
                              {"reason": "max_output_tokens"} if capped else None)

    def _response(self, status: str, output: list[Any] | None = None,
                  usage: dict[str, Any] | None = None,
                  incomplete: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "id": self.id, "created_at": self.created, "incomplete_details": incomplete,
            "instructions": None, "metadata": None, "model": self.model, "object": "response",
            "output": output or [], "parallel_tool_calls": True, "temperature": 1.0,
            "tool_choice": "none", "tools": [], "top_p": 1.0, "background": False,
            "max_output_tokens": None, "max_tool_calls": None,
            "previous_response_id": None, "prompt": None, "reasoning": None,
            "service_tier": "auto", "status": status, "text": None, "top_logprobs": None,
            "truncation": "disabled", "usage": usage, "user": None, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "kv_transfer_params": None, "ec_transfer_params": None,
            "input_messages": None, "output_messages": None, **self.echo,
        }
