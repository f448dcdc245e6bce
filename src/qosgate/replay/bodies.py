"""The bytes of one replayed request: the body (exact prompt length as token ids on
``/v1/completions``, or text of about the right length on ``/v1/chat/completions``) and the
head with the class and the tenant's key.

Token ids are three-digit numbers (100..999): valid in any real vocabulary, and four JSON
characters each (``"123,"``), so a gateway's or the stand-in's characters/4 estimate of the
prompt is its true length too. They are drawn from the replay's ``seed`` and the request's id,
so two requests share no prefix by accident, nor do two replays (a prefix-cache hit would
flatter the engine), while a replay given the same seed sends the same bytes. A trace that
names its prompt blocks (Mooncake's ``hash_ids``) gets them: each block id is the same tokens
in every request that names it, as the trace's shared prefixes were.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import TypeVar

from qosgate.replay.plan import Planned

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# plain words of one token each in common tokenizers, ~4.5 characters with the space
T = TypeVar("T")
_WORDS = ("time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child",
          "world", "school", "state", "family", "student", "group", "country", "problem",
          "hand", "part", "place", "case", "week", "company", "system", "program", "question")


def _tokens(seed: str, p: Planned, draw: Callable[[random.Random], T]) -> list[T]:
    """``p.prompt`` draws: the trace's blocks first (each from its block id), then the
    request's own."""
    out: list[T] = []
    if p.prefix is not None:
        for key in p.prefix.keys:
            if len(out) >= p.prompt:
                break
            rng = random.Random(f"replay:{seed}:block:{key}")
            out += [draw(rng) for _ in range(p.prefix.block_tokens)]
    rng = random.Random(f"replay:{seed}:{p.rid}")
    out += [draw(rng) for _ in range(p.prompt - len(out))]
    return out[: p.prompt]


def token_ids(seed: str, p: Planned) -> list[int]:
    return _tokens(seed, p, lambda rng: rng.randrange(100, 1000))


def text_of(seed: str, p: Planned) -> str:
    """About ``p.prompt`` tokens of text (one word a token)."""
    return " ".join(_tokens(seed, p, lambda rng: rng.choice(_WORDS)))


def body(p: Planned, model: str, token_prompts: bool, seed: str = "",
         ignore_eos: bool = True) -> tuple[str, bytes]:
    """(path, JSON body): streamed, usage included, ``max_tokens`` = the output length with
    ``ignore_eos`` so the engine generates exactly that many tokens where it honours it (an
    engine that does not may stop early at its end-of-sequence token: the record then has fewer
    output tokens than asked, and TPOT is over those it sent)."""
    doc: dict[str, object] = {
        "model": model,
        "max_tokens": p.output,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if ignore_eos:  # (an engine that refuses the field answers 400 naming it: --no-ignore-eos)
        doc["ignore_eos"] = True
    if token_prompts:
        doc["prompt"] = token_ids(seed, p)
        path = COMPLETIONS
    else:
        doc["messages"] = [{"role": "user", "content": text_of(seed, p)}]
        path = CHAT
    return path, json.dumps(doc, separators=(",", ":")).encode()


def head(prefix: str, host: str, path: str, p: Planned) -> bytes:
    """The request's head up to (not including) the Content-Length value, as ``Pool.request``
    takes it: its class as ``x-qos-class``, its tenant's key as the bearer token."""
    auth = f"Authorization: Bearer {p.api_key}\r\n" if p.api_key else ""
    return (
        f"POST {prefix}{path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\n{auth}x-qos-class: {p.service_class}\r\n"
        "Content-Length: "
    ).encode()
