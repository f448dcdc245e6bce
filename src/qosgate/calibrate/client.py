"""One streamed ``/v1/completions`` request, timed token by token (stdlib ``http.client``).

Threads, one connection each, rather than an async client: a probe runs at most a few dozen
requests at once, ``http.client`` decodes chunked streams by itself, and no client library
becomes a dependency of the command.

The prompt is a list of token ids (vLLM takes them as they are, so its length is exact), each id
three digits and the JSON compact: ``[123,456]`` is 4 bytes a token, which is also what an
engine that counts characters / 4 (the stand-in) counts. The length used in the fit is the
engine's own, ``usage.prompt_tokens``, whatever the engine made of the prompt.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit


class ProbeError(RuntimeError):
    """The endpoint did not answer as an OpenAI-compatible completions server does."""


@dataclass(slots=True)
class Timed:
    """A streamed request's times (``time.monotonic``): sent, then one per token chunk."""

    sent: float
    tokens: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def ttft(self) -> float:
        return self.tokens[0] - self.sent


def token_ids(n: int, rng: random.Random) -> list[int]:
    """``n`` random three-digit ids: distinct prompts from their first block on, so that no
    probe is served from the prefix cache."""
    return [rng.randrange(100, 1000) for _ in range(n)]


def get_json(base: str, path: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(base + path, timeout=timeout) as r:
        return json.loads(r.read())


def get_text(base: str, path: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(base + path, timeout=timeout) as r:
        return bytes(r.read()).decode("utf-8", "replace")


def stream_completion(base: str, model: str, prompt: list[int], max_tokens: int,
                      timeout: float = 120.0, headers: dict[str, str] | None = None) -> Timed:
    """POST a streamed completion of exactly ``max_tokens`` tokens (``ignore_eos``) and time
    each chunk that carries a token."""
    u = urlsplit(base)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
    body = json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }, separators=(",", ":")).encode()
    try:
        t = Timed(sent=time.monotonic())
        conn.request("POST", u.path.rstrip("/") + "/v1/completions", body=body,
                     headers={"content-type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        if resp.status != 200:
            raise ProbeError(f"/v1/completions answered {resp.status}: "
                             f"{resp.read(500).decode('utf-8', 'replace')}")
        while True:
            line = resp.readline()
            if not line:
                break
            now = time.monotonic()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            for c in chunk.get("choices") or ():
                # a token may decode to no text (a random id); only a textless chunk that
                # ends a stream after its tokens (the stand-in's) is no token
                if c.get("text") or c.get("finish_reason") is None or not t.tokens:
                    t.tokens.append(now)
            usage = chunk.get("usage")
            if usage:
                t.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                t.completion_tokens = int(usage.get("completion_tokens") or 0)
    finally:
        conn.close()
    if not t.tokens:
        raise ProbeError("a streamed completion carried no token")
    return t


class Engine(Protocol):
    """Where the probe's requests go. ``run`` sends its prompts at once and returns their
    timings, taken on the clock ``now`` reads: the probe's deadline uses that clock too, so an
    engine model stepped in virtual time (the tests') times the probe exactly."""

    def now(self) -> float: ...

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[Timed]: ...


@dataclass(frozen=True, slots=True)
class HttpEngine:
    """A live OpenAI-compatible endpoint: one thread and connection per prompt, released
    together by a barrier so that n requests reach the engine in the same step."""

    base: str
    model: str

    def now(self) -> float:
        return time.monotonic()

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[Timed]:
        if len(prompts) == 1:
            return [stream_completion(self.base, self.model, prompts[0], max_tokens)]
        gate = threading.Barrier(len(prompts))

        def go(ids: list[int]) -> Timed:
            gate.wait()
            return stream_completion(self.base, self.model, ids, max_tokens)

        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            return list(pool.map(go, prompts))
