"""OpenAI answer objects for engines that generate in-process (the gateway's in-process path and
the vLLM stand-in share this): ``chat.completion``, ``chat.completion.chunk`` and
``text_completion``, with ``usage``, ``finish_reason`` and the closing ``data: [DONE]``; the
Responses API's are ``responses_api.py`` (the module's name keeps "responses" for that API).

Per-token chunks are built from a precomputed prefix and suffix around the JSON-encoded text, so a
token costs one small encode and one concatenation.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import msgspec

from qosgate.wire import sse
from qosgate.wire.engine_request import Route
from qosgate.wire.responses_api import ResponsesFormatter

_enc = msgspec.json.Encoder().encode


def _usage(prompt: int, completion: int,
           details: dict[str, object] | None = None) -> dict[str, object]:
    usage: dict[str, object] = {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    if details is not None:
        usage["prompt_tokens_details"] = details
    return usage


def prompt_details(cached: int | None, only_cached: bool = False) -> dict[str, object] | None:
    """``usage.prompt_tokens_details`` as vLLM 0.32 writes it with
    ``--enable-prompt-tokens-details`` (None: not asked for). Its three members, except in a
    completions stream, which sets only ``cached_tokens`` (its chunks leave unset members out)."""
    if cached is None:
        return None
    if only_cached:
        return {"cached_tokens": cached}
    return {"cached_tokens": cached, "created_cache_tokens": None, "multimodal_tokens": None}


class Formatter:
    """Formats one response (streamed or whole) of ``route`` for request ``rid``.

    ``token_ids`` is vLLM's ``return_token_ids`` for an engine that mirrors vLLM (the stand-in):
    None leaves its members out (the gateway's own engines), False writes them null (vLLM
    without the flag), True writes the ids (``prompt_ids`` the prompt's) where vLLM 0.32 does.
    """

    __slots__ = ("_first", "_mid", "_pre", "_suf", "created", "id", "include_usage", "model",
                 "prompt_ids", "route", "token_ids")

    def __init__(
        self, route: Route, rid: str, model: str, include_usage: bool = False,
        token_ids: bool | None = None, prompt_ids: tuple[int, ...] | None = None,
    ) -> None:
        self.route = route
        self.id = ("chatcmpl-" if route == "chat" else "cmpl-") + rid
        self.model = model
        self.created = int(time.time())
        self.include_usage = include_usage
        self.token_ids = token_ids
        self.prompt_ids = list(prompt_ids) if token_ids and prompt_ids is not None else None
        self._first = True  # the next token is the answer's first
        head = _enc(
            {
                "id": self.id,
                "object": "chat.completion.chunk" if route == "chat" else "text_completion",
                "created": self.created,
                "model": model,
            }
        )[:-1]
        if route == "chat":
            self._pre = sse.DATA + head + b',"choices":[{"index":0,"delta":{"content":'
            self._mid = b'},"logprobs":null,"finish_reason":null'
        else:
            self._pre = sse.DATA + head + b',"choices":[{"index":0,"text":'
            self._mid = b',"logprobs":null,"finish_reason":null'
            if token_ids is not None:
                self._mid += b',"stop_reason":null'
        self._suf = self._mid + b"}]}" + sse.EVENT_END

    # ------------------------------------------------------------------ streaming
    def opening(self) -> bytes:
        """Sent with the first token: the assistant role delta (chat only)."""
        if self.route != "chat":
            return b""
        chunk: dict[str, object] = {**self._head(), "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]}
        if self.token_ids is not None:
            chunk["prompt_token_ids"] = self.prompt_ids
            chunk["prompt_text"] = None
        return sse.json_event(_enc(chunk))

    def token(self, text: str, token_id: int = -1) -> bytes:
        """One token's chunk; ``token_id`` is written where the ids are asked for."""
        if self.token_ids is None:
            return self._pre + _enc(text) + self._suf
        ids = b"null" if not self.token_ids else b"[%d]" % token_id
        if self.route == "chat":
            tail = b',"token_ids":' + ids
        else:
            prompt = _enc(self.prompt_ids) if self._first else b"null"
            tail = b',"prompt_token_ids":' + prompt + b',"token_ids":' + ids
        self._first = False
        return self._pre + _enc(text) + self._mid + tail + b"}]}" + sse.EVENT_END

    def closing(self, finish_reason: str, prompt: int, completion: int,
                cached: int | None = None) -> bytes:
        """The finish chunk, the usage chunk if asked for, and ``[DONE]``; ``cached``: the
        prompt tokens taken from a prefix cache, to report (``prompt_details``), or None."""
        if self.route == "chat":
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason}
        out = self._chunk(choice)
        if self.include_usage:
            out += sse.json_event(
                _enc({**self._head(), "choices": [], "usage": _usage(
                    prompt, completion, prompt_details(cached, self.route != "chat"))}))
        return out + sse.DONE

    def error_event(self, message: str, type_: str, code: str | int) -> bytes:
        return sse.error_event(message, type_, code)

    # ------------------------------------------------------------------ whole responses
    def whole(self, text: str, finish_reason: str, prompt: int, completion: int,
              cached: int | None = None, token_ids: list[int] | None = None) -> bytes:
        """The whole answer; ``token_ids``: the answer's ids, written where they are asked
        for (``self.token_ids``)."""
        ids = token_ids if self.token_ids else None
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
        if self.token_ids is not None:
            choice["token_ids"] = ids
            if self.route != "chat":
                choice["prompt_token_ids"] = self.prompt_ids
        answer: dict[str, object] = {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": _usage(prompt, completion, prompt_details(cached)),
        }
        if self.token_ids is not None and self.route == "chat":
            answer["prompt_token_ids"] = self.prompt_ids
        return _enc(answer)

    # ------------------------------------------------------------------ helpers
    def _head(self) -> dict[str, object]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk" if self.route == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
        }

    def _chunk(self, choice: dict[str, object]) -> bytes:
        return sse.json_event(_enc({**self._head(), "choices": [choice]}))


ModelCard = dict[str, Any]


def model_card(
    name: str, owned_by: str, max_model_len: int | None = None, created: int | None = None
) -> ModelCard:
    """One ``/v1/models`` entry with vLLM 0.32's members, in its order (``ModelCard`` in
    vllm/entrypoints/openai/protocol.py): ``root`` is the served model, ``parent`` null for a
    base model, ``max_model_len`` the context an engine accepts."""
    now = int(time.time()) if created is None else created
    return {
        "id": name,
        "object": "model",
        "created": now,
        "owned_by": owned_by,
        "root": name,
        "parent": None,
        "max_model_len": max_model_len,
        "permission": [{
            "id": f"modelperm-{uuid.uuid4().hex}",
            "object": "model_permission",
            "created": now,
            "allow_create_engine": False,
            "allow_sampling": True,
            "allow_logprobs": True,
            "allow_search_indices": False,
            "allow_view": True,
            "allow_fine_tuning": False,
            "organization": "*",
            "group": None,
            "is_blocking": False,
        }],
    }


def models_list(cards: list[ModelCard]) -> dict[str, object]:
    return {"object": "list", "data": cards}


def context_of(card: ModelCard) -> int | None:
    """The context length an entry reports (vLLM: ``max_model_len``; SGLang and llama.cpp's
    server name it otherwise), None if it says none."""
    for key in ("max_model_len", "context_length", "n_ctx"):
        v = card.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    meta = card.get("meta")
    if isinstance(meta, dict):
        v = meta.get("n_ctx_train")
        if isinstance(v, int) and v > 0:
            return v
    return None


def merge_cards(per_replica: list[list[ModelCard]]) -> list[ModelCard]:
    """The fleet's ``/v1/models``: each model once, as its first replica lists it, with the
    smallest context any replica reports (a request must fit wherever it runs)."""
    merged: dict[str, ModelCard] = {}
    for cards in per_replica:
        for card in cards:
            mid = card.get("id")
            if not isinstance(mid, str):
                continue
            have = merged.get(mid)
            if have is None:
                merged[mid] = dict(card)
                continue
            a, b = context_of(have), context_of(card)
            if b is not None and (a is None or b < a):
                have["max_model_len"] = b
    return list(merged.values())


def formatter_for(route: Route, rid: str, model: str, include_usage: bool,
                  body: bytes, token_ids: bool | None = None,
                  prompt_ids: tuple[int, ...] | None = None) -> Formatter | ResponsesFormatter:
    """The answer's formatter for ``route``: chat and completions chunks, or the Responses
    API's events (the vLLM stand-in serves it; the gateway's built-in engines refuse it).
    ``token_ids``/``prompt_ids``: see ``Formatter``."""
    if route == "responses":
        return ResponsesFormatter(rid, model, body)
    return Formatter(route, rid, model, include_usage, token_ids, prompt_ids)
