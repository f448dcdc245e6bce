"""A multi-turn chat client for the cache-routing benches (``bench/cache_routing.py`` on
stand-ins, the real-vLLM one): ``sessions`` conversations, each ``turns`` turns; every turn sends
the whole conversation so far -- one system prompt shared by every session, then the user and
assistant messages -- plus a new user message, and appends the answer it streamed back, so the
context grows by a turn each time and its head is the previous turn's prompt. A session names
itself in the ``x-session-id`` header (and, with ``user_field``, OpenAI's ``user``).

Seeded: the system prompt, every user message, the think time between a session's turns and
the sessions' start times come from ``seed``; only the answers' text comes from the server.
Streams with ``include_usage``: each turn records its TTFT (to the first content chunk), its
end, the engine's prompt and output tokens and, where the engine reports it,
``usage.prompt_tokens_details.cached_tokens``.

    results = asyncio.run(run_sessions("http://127.0.0.1:8000", MultiTurn(sessions=8)))
    print(summarize(results))
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.vllm_common import pct  # noqa: E402
from tests.support.metrics import metric_values  # noqa: E402

WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "on", "be",
         "by", "this", "are", "from", "at", "or", "an", "cache", "prefix", "replica", "engine",
         "request", "session", "token", "answer", "question", "model", "routing", "fleet")


@dataclass(frozen=True)
class MultiTurn:
    """The conversation workload (character counts; ~4 characters per token)."""

    sessions: int = 8
    turns: int = 6
    system_chars: int = 4000  # the one system prompt every session starts with
    user_chars: tuple[int, int] = (200, 800)  # a new user message's length, uniform
    max_tokens: int = 64  # each answer's length (a cap the filler model runs to)
    think_s: float = 0.5  # mean pause between a session's turns (exponential)
    ramp_s: float = 2.0  # sessions start uniformly over this
    seed: int = 1
    model: str | None = None  # None: the server's first
    user_field: bool = False  # also send the session as OpenAI's ``user``
    timeout_s: float = 120.0


@dataclass
class Turn:
    """One request of a session and what became of it."""

    session: int
    turn: int
    sent: float
    status: int = 0
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str = ""
    headers: dict[str, str] = field(default_factory=dict)


def words(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


async def run_sessions(base_url: str, w: MultiTurn, api_key: str | None = None,
                       headers: dict[str, str] | None = None) -> list[Turn]:
    """Every session's turns against ``base_url`` (an OpenAI server: the gateway, an engine),
    concurrently; the turns in the order they were sent."""
    rng = random.Random(w.seed)
    system = words(rng, w.system_chars)
    plans = []
    for s in range(w.sessions):
        srng = random.Random(rng.getrandbits(64))
        plans.append((s, rng.uniform(0.0, w.ramp_s), srng))
    out: list[Turn] = []
    hdrs = {"content-type": "application/json", **(headers or {})}
    if api_key:
        hdrs["authorization"] = f"Bearer {api_key}"
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=w.timeout_s)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as http:
        t0 = time.monotonic()
        await asyncio.gather(*(
            _session(http, base_url, w, system, s, t0 + start, srng, hdrs, out)
            for s, start, srng in plans
        ))
    out.sort(key=lambda t: t.sent)
    return out


async def _session(http: aiohttp.ClientSession, base_url: str, w: MultiTurn, system: str,
                   s: int, start: float, rng: random.Random, hdrs: dict[str, str],
                   out: list[Turn]) -> None:
    await asyncio.sleep(max(0.0, start - time.monotonic()))
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    sid = f"session-{w.seed}-{s}"
    for k in range(w.turns):
        messages.append({"role": "user", "content": words(rng, rng.randint(*w.user_chars))})
        body: dict[str, Any] = {"messages": messages, "max_tokens": w.max_tokens,
                                "stream": True, "stream_options": {"include_usage": True}}
        if w.model is not None:
            body["model"] = w.model
        if w.user_field:
            body["user"] = sid
        turn = Turn(s, k, time.monotonic())
        out.append(turn)
        answer = await _one(http, base_url, {**hdrs, "x-session-id": sid}, body, turn)
        if answer is None:
            return  # refused or failed: the conversation ends here
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(rng.expovariate(1.0 / w.think_s) if w.think_s > 0 else 0.0)


async def _one(http: aiohttp.ClientSession, base_url: str, hdrs: dict[str, str],
               body: dict[str, Any], turn: Turn) -> str | None:
    """One streamed turn: its answer's text, or None when it did not complete."""
    parts: list[str] = []
    try:
        async with http.post(base_url + "/v1/chat/completions", json=body,
                             headers=hdrs) as r:
            turn.status = r.status
            turn.headers = {k.lower(): v for k, v in r.headers.items()}
            if r.status != 200:
                turn.error = (await r.read()).decode(errors="replace")[:200]
                return None
            async for line in r.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    turn.error = str(ev["error"])[:200]
                    return None
                for ch in ev.get("choices") or ():
                    text = (ch.get("delta") or {}).get("content")
                    if text:
                        if turn.ttft is None:
                            turn.ttft = time.monotonic() - turn.sent
                        parts.append(text)
                usage = ev.get("usage")
                if usage:
                    turn.prompt_tokens = usage.get("prompt_tokens")
                    turn.output_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    turn.cached_tokens = details.get("cached_tokens")
    except (aiohttp.ClientError, TimeoutError) as exc:
        turn.error = repr(exc)[:200]
        return None
    turn.e2e = time.monotonic() - turn.sent
    return "".join(parts)


def summarize(turns: list[Turn]) -> dict[str, float]:
    """TTFT p50/p99 (s), output tokens/s over the run, completed and refused (HTTP 4xx/5xx)
    turns, and the engines' cached share of the prompt tokens where they reported it."""
    done = [t for t in turns if t.e2e is not None]
    ttfts = [t.ttft for t in done if t.ttft is not None]
    span = (max(t.sent + (t.e2e or 0.0) for t in done) - min(t.sent for t in turns)
            if done else float("nan"))
    reported = [t for t in done if t.cached_tokens is not None and t.prompt_tokens]
    prompt = sum(t.prompt_tokens or 0 for t in reported)
    return {
        "turns": float(len(turns)),
        "completed": float(len(done)),
        "refused": float(sum(1 for t in turns if t.status >= 400)),
        "failed": float(sum(1 for t in turns if t.e2e is None and t.status < 400)),
        "ttft_p50": pct(ttfts, 0.50),
        "ttft_p99": pct(ttfts, 0.99),
        "tokens_per_s": sum(t.output_tokens for t in done) / span if done else 0.0,
        "reported_cached_share": (sum(t.cached_tokens or 0 for t in reported) / prompt
                                  if prompt else float("nan")),
    }


def prefix_cache_counts(engine_url: str) -> tuple[float, float]:
    """An engine's ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``
    (tokens; vLLM 0.32's counters, as the stand-in exports them), summed over its series."""
    with urllib.request.urlopen(engine_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    return (sum(metric_values(text, "vllm:prefix_cache_queries_total").values()),
            sum(metric_values(text, "vllm:prefix_cache_hits_total").values()))
