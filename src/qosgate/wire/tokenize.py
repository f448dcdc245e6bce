"""The engine's ``POST /tokenize`` request for a completion request: its prompt's token ids as
the engine will see them.

vLLM's ``/tokenize`` takes chat ``messages`` and renders them with the same template and
defaults as ``/v1/chat/completions`` (``serve/tokenize/serving.py``: ``preprocess_chat``), or a
``prompt`` as ``/v1/completions`` does; the members that change the rendering are copied over,
the rest (sampling, streaming) does not matter to the ids.
"""

from __future__ import annotations

from typing import Any

import msgspec

from qosgate.wire.engine_request import Route
from qosgate.wire.parse import RENDERED

# the members of a chat request that change its rendered prompt (vLLM's TokenizeChatRequest)
_CHAT_RENDERING: tuple[str, ...] = ("model", "messages", *RENDERED)
_COMPLETION_RENDERING = ("model", "prompt", "add_special_tokens")
_decoder = msgspec.json.Decoder(dict[str, Any])


def tokenize_request(body: bytes, route: Route) -> bytes | list[int] | None:
    """The ``/tokenize`` body for ``body``; or the prompt's ids themselves where the client sent
    ids (a completion with a token-id prompt); None where one prompt cannot be told (a batch of
    prompts, embeddings, a body that is not a JSON object)."""
    try:
        req = _decoder.decode(body)
    except msgspec.DecodeError:
        return None
    if route == "chat":
        if not isinstance(req.get("messages"), list):
            return None
        members = _CHAT_RENDERING
    elif route == "completions":
        prompt = req.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]  # one prompt in a list
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt
        if not isinstance(prompt, str):
            return None
        req["prompt"] = prompt
        members = _COMPLETION_RENDERING
    else:
        return None
    return msgspec.json.encode({k: req[k] for k in members if k in req})


def token_ids(answer: bytes) -> list[int] | None:
    """The ids in ``/tokenize``'s answer (``{"count", "tokens", ...}``); None if it has none."""
    try:
        got = msgspec.json.decode(answer, type=dict[str, Any])
    except msgspec.DecodeError:
        return None
    ids = got.get("tokens")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        return None
    return ids
