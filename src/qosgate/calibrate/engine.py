"""Where the probe's requests go (``Engine``), and the live one (``HttpEngine``): a streamed
``/v1/completions`` request per prompt, timed token by token by the measuring client
(``qosgate.measure``), seen by the probe as a ``Timed``.

The prompt is a list of token ids (vLLM takes them as they are, so its length is exact), each id
three digits and the JSON compact: ``[123,456]`` is 4 bytes a token, which is also what an
engine that counts characters / 4 (the stand-in) counts. The length used in the fit is the
engine's own, ``usage.prompt_tokens``, whatever the engine made of the prompt.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Protocol

from qosgate.measure import Answer, send
from qosgate.runtime.upstream.transport import Pool

REQUEST_TIMEOUT_S = 120.0  # one request's bound, its connection and whole stream


class ProbeError(RuntimeError):
    """The endpoint did not answer as an OpenAI-compatible completions server does."""


@dataclass(slots=True)
class Timed:
    """A streamed request's times on its engine's clock (``Engine.now``): sent, then one per
    token chunk."""

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


def request_body(model: str, prompt: list[int], max_tokens: int) -> bytes:
    """A streamed completion of exactly ``max_tokens`` tokens (``ignore_eos``), with usage."""
    return json.dumps({
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
    }, separators=(",", ":")).encode()


def timed(ans: Answer) -> Timed:
    """The probe's view of a measured answer (sent with ``t0`` 0, so its times are the clock's
    own readings), or ``ProbeError`` where the engine did not stream tokens."""
    if ans.status not in (0, 200):
        raise ProbeError(f"/v1/completions answered {ans.status}: {ans.detail}")
    if ans.state == "cancelled":
        raise ProbeError(f"/v1/completions: no answer within {REQUEST_TIMEOUT_S:g} s")
    if ans.reason == "connection_error":
        raise ProbeError(f"/v1/completions: {ans.detail}")
    if not ans.chunk_times:
        raise ProbeError("a streamed completion carried no token")
    return Timed(ans.sent_at, list(ans.chunk_times), ans.prompt_tokens, ans.output_tokens)


class Engine(Protocol):
    """Where the probe's requests go. ``run`` sends its prompts at once and returns their
    timings, taken on the clock ``now`` reads: the probe's deadline uses that clock too, so an
    engine model stepped in virtual time (the tests') times the probe exactly."""

    def now(self) -> float: ...

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[Timed]: ...


@dataclass(frozen=True, slots=True)
class HttpEngine:
    """A live OpenAI-compatible endpoint, through the measuring client: a run's requests are
    sent in the same turn of one event loop, so that n requests reach the engine in the same
    step."""

    base: str
    model: str

    def now(self) -> float:
        return time.monotonic()

    def run(self, prompts: list[list[int]], max_tokens: int) -> list[Timed]:
        answers = asyncio.run(self._send(prompts, max_tokens))
        return [timed(a) for a in answers]

    async def _send(self, prompts: list[list[int]], max_tokens: int) -> list[Answer]:
        pool = Pool(self.base, connect_timeout_s=10.0, api_key=None)
        head = pool.head("POST", "/v1/completions")

        async def one(ids: list[int]) -> Answer:
            ans = Answer()
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    await send(pool, head, request_body(self.model, ids, max_tokens), 0.0, ans,
                               clock=self.now)
            except TimeoutError:
                pass  # ``send`` recorded it as cancelled
            return ans

        try:
            return list(await asyncio.gather(*(one(ids) for ids in prompts)))
        finally:
            pool.close()
