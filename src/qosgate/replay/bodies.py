"""The bytes of one replayed request: the body (exact prompt length as token ids on
``/v1/completions``, or text of about the right length on ``/v1/chat/completions``) and the
head with the class and the tenant's key.

Token ids are three-digit numbers (100..999): valid in any real vocabulary, and four JSON
characters each (``"123,"``), so a gateway's or the stand-in's characters/4 estimate of the
prompt is its true length too. They are drawn per request from its id, so two requests share no
prefix by accident (a prefix-cache hit would flatter the engine).
"""

from __future__ import annotations

import json
import random

from qosgate.replay.plan import Planned

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
# plain words of one token each in common tokenizers, ~4.5 characters with the space
_WORDS = ("time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child",
          "world", "school", "state", "family", "student", "group", "country", "problem",
          "hand", "part", "place", "case", "week", "company", "system", "program", "question")


def token_ids(rid: str, n: int) -> list[int]:
    rng = random.Random(f"replay:{rid}")
    return [rng.randrange(100, 1000) for _ in range(n)]


def text_of(rid: str, n: int) -> str:
    """About ``n`` tokens of text (one word a token)."""
    rng = random.Random(f"replay:{rid}")
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def body(p: Planned, model: str, token_prompts: bool) -> tuple[str, bytes]:
    """(path, JSON body): streamed, usage included, ``max_tokens`` = the output length with
    ``ignore_eos`` so the engine generates exactly that many tokens where it honours it (an
    engine that does not may stop early at its end-of-sequence token: the record then has fewer
    output tokens than asked, and TPOT is over those it sent)."""
    doc: dict[str, object] = {
        "model": model,
        "max_tokens": p.output,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if token_prompts:
        doc["prompt"] = token_ids(p.rid, p.prompt)
        path = COMPLETIONS
    else:
        doc["messages"] = [{"role": "user", "content": text_of(p.rid, p.prompt)}]
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
