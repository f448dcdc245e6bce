"""Cache-aware routing over two real vLLMs (the session's ``priority`` and ``fcfs`` ones, as one
fleet): a conversation's turns land on the replica that holds its prefix, judged by vLLM's own
prefix-cache counters; the same with precise mode, whose index follows vLLM's KV events; and the
subscriber itself against real vLLM: the keys it makes of vLLM's events are the keys of the
prompt's token ids, and vLLM's prefix-cache reset clears them.

Why this fails for a cache-blind router: the two conversations' first turns go at once, so they
spread over both replicas; every later turn goes alone to an idle fleet, where ``least-load``
takes the first replica every time, and the conversation that started on the other one finds
nothing of its prefix there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qosgate.runtime.kv_events import KVEventFeed
from qosgate.wire.kv_events import CacheChange, token_prefix
from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import Server, start_gateway
from tests.support.vllm import KV_EVENTS, KV_TOPIC, MODEL, client, wait_idle
from tests.support.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

BLOCK = 128  # vLLM's block size on the CPU backend (read from its events in precise mode)
TURNS = 3
FLEET_CONFIG = """
fleet: {{router: {router}, window: {{mode: fixed}}}}
upstreams:
  - {{url: {a}, name: vllm-a, max_window: 4, priority_polarity: vllm, models: [{model}]{ev_a}}}
  - {{url: {b}, name: vllm-b, max_window: 4, models: [{model}]{ev_b}}}
"""
WORDS = ("river", "stone", "lantern", "orbit", "meadow", "copper", "signal", "harbor", "violet",
         "engine", "glacier", "ember", "canyon", "quartz", "falcon", "tide", "marble", "pine")


def cache_counts(engine: Server) -> tuple[float, float]:
    """vLLM's ``prefix_cache_queries_total`` and ``prefix_cache_hits_total`` (prompt tokens)."""
    _, _, text = http("GET", engine.url + "/metrics")
    t = text.decode()
    return (sum(metric_values(t, "vllm:prefix_cache_queries_total").values()),
            sum(metric_values(t, "vllm:prefix_cache_hits_total").values()))


def system_prompt(rng: random.Random, words: int = 420) -> str:
    """A long system prompt of its own (several of vLLM's blocks), unlike any other test's."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(params=[
    "cache-aware", "precise",
    # the control: the cache-blind router must fail the test, or the test proves nothing
    pytest.param("least-load", marks=pytest.mark.xfail(strict=True, reason="cache-blind")),
])
def fleet(request: pytest.FixtureRequest, vllm_priority: Server, vllm_fcfs: Server,
          vllm_tmp: Path) -> Iterator[tuple[Server, list[Server]]]:
    precise = request.param == "precise"
    engines = [vllm_priority, vllm_fcfs]
    ev = [f", kv_events: '{KV_EVENTS[e.url]}', kv_events_topic: {KV_TOPIC}" if precise else ""
          for e in engines]
    cfg = vllm_tmp / f"gateway-fleet-{request.param}.yaml"
    router = "least-load" if request.param == "least-load" else "cache-aware"
    cfg.write_text(FLEET_CONFIG.format(router=router, a=engines[0].url, b=engines[1].url,
                                       model=MODEL, ev_a=ev[0], ev_b=ev[1]))
    gw = start_gateway(vllm_tmp, "--config", str(cfg))
    yield gw, engines
    gw.stop()


def test_turns_of_a_session_land_where_their_prefix_is_cached(
    fleet: tuple[Server, list[Server]], request: pytest.FixtureRequest
) -> None:
    gw, engines = fleet
    for e in engines:
        wait_idle(e)
    rng = random.Random(request.node.name)  # each variant its own prompts: nothing cached yet
    c = client(gw)
    chats: list[list[dict[str, str]]] = [
        [{"role": "system", "content": system_prompt(rng)},
         {"role": "user", "content": f"Name {k + 2} colours."}] for k in range(2)
    ]
    prompt_tokens = [0, 0]

    def turn(s: int) -> None:
        r = c.chat.completions.create(model=MODEL, messages=chats[s],  # type: ignore[arg-type]
                                      max_tokens=12, temperature=0)
        assert r.usage is not None
        prompt_tokens[s] = r.usage.prompt_tokens
        chats[s] += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": f"And {rng.choice(WORDS)}?"}]

    # first turns at once: they spread over the fleet (nothing is cached anywhere yet)
    before = [cache_counts(e) for e in engines]
    threads = [threading.Thread(target=turn, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(prompt_tokens), "a first turn failed"
    assert wait_until(lambda: all(cache_counts(e)[0] > b[0] for e, b in zip(
        engines, before, strict=True)), 10), "the first turns did not spread over both replicas"

    # later turns one at a time, alternating: each lands alone, on an idle fleet
    where: dict[int, set[int]] = {0: set(), 1: set()}
    for _ in range(TURNS - 1):
        for s in range(2):
            for e in engines:
                wait_idle(e)
            cached_before = prompt_tokens[s] // BLOCK * BLOCK  # its last prompt's whole blocks
            before = [cache_counts(e) for e in engines]
            turn(s)
            queried = sum(b[0] for b in before)
            assert wait_until(lambda q=queried: sum(cache_counts(e)[0] for e in engines) > q, 10)
            after = [cache_counts(e) for e in engines]
            landed = [i for i in range(2) if after[i][0] > before[i][0]]
            assert len(landed) == 1, (s, before, after)
            i = landed[0]
            where[s].add(i)
            hits = after[i][1] - before[i][1]
            assert hits >= cached_before, (
                f"session {s}'s turn found {hits:.0f} of its {cached_before} cached prompt "
                f"tokens on replica {i}: it left the replica that holds its prefix")
    assert len(where[0]) == 1 and len(where[1]) == 1 and where[0] != where[1], where


def test_subscriber_follows_real_vllm_events(vllm_fcfs: Server) -> None:
    """The feed's keys for what vLLM stored are the keys of the prompt's token ids (from its
    ``/tokenize``), and vLLM's prefix-cache reset (``AllBlocksCleared``) empties them."""
    wait_idle(vllm_fcfs)
    messages = [{"role": "system", "content": system_prompt(random.Random("events"))},
                {"role": "user", "content": "Hello?"}]
    _, _, tok = http("POST", vllm_fcfs.url + "/tokenize",
                     json.dumps({"model": MODEL, "messages": messages}).encode(),
                     {"content-type": "application/json"})
    ids: list[int] = json.loads(tok)["tokens"]
    assert len(ids) >= 3 * BLOCK

    async def scenario() -> tuple[KVEventFeed, set[int]]:
        changes: list[CacheChange] = []
        stored: set[int] = set()
        feed = KVEventFeed("vllm-fcfs", KV_EVENTS[vllm_fcfs.url], changes.append, KV_TOPIC)
        feed.start()
        loop = asyncio.get_running_loop()
        try:
            # PUB/SUB drops what is published before the subscription is in place (and vLLM
            # publishes a block once, not again when it is reused): fresh prompts until one's
            # events arrive, then the one under test
            probe = 0
            while feed.batches == 0:
                probe += 1
                other = [{"role": "user", "content": system_prompt(random.Random(probe))}]
                await loop.run_in_executor(None, _chat, vllm_fcfs, other)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(2):
                        while feed.batches == 0:
                            await asyncio.sleep(0.02)
            await loop.run_in_executor(None, _chat, vllm_fcfs, messages)
            async with asyncio.timeout(30):
                while feed.block_size is None or not stored.issuperset(
                        token_prefix(ids, feed.block_size).keys):
                    stored.update(k for ch in changes for k in ch.stored)
                    await asyncio.sleep(0.02)
            n = len(changes)
            await loop.run_in_executor(None, _reset, vllm_fcfs)
            # vLLM publishes what its cache did at its next step: an idle engine needs one (a
            # prompt shorter than a block: it stores nothing)
            await loop.run_in_executor(None, _chat, vllm_fcfs, [{"role": "user", "content": "Hi"}])
            async with asyncio.timeout(30):
                while not any(ch.cleared for ch in changes[n:]):
                    await asyncio.sleep(0.05)
        finally:
            await feed.close()
        return feed, stored

    feed, stored = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert feed.block_size == BLOCK
    keys = token_prefix(ids, BLOCK).keys
    assert len(keys) == len(ids) // BLOCK and stored.issuperset(keys)
    assert feed.blocks.keys == {} and feed.garbled == 0


def _chat(engine: Server, messages: list[dict[str, Any]]) -> None:
    status, _, body = http("POST", engine.url + "/v1/chat/completions", json.dumps(
        {"model": MODEL, "messages": messages, "max_tokens": 2}).encode(),
        {"content-type": "application/json"}, timeout=60)
    assert status == 200, body


def _reset(engine: Server) -> None:
    status, _, body = http("POST", engine.url + "/reset_prefix_cache", timeout=30)
    assert status == 200, body
