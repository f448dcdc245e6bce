"""Precise mode's parts without vLLM: its KV-event batches re-keyed into ``wire.prefix.chain``'s
space, the ``/tokenize`` body made from a request, and the subscriber over a real ZMQ socket
(vLLM's wire format: topic, 8-byte sequence, msgpack batch). The same against real vLLM is in
``tests/e2e/vllm/test_cache_routing.py``."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgspec
import pytest

from qosgate.runtime.kv_events import KVEventFeed
from qosgate.runtime.precise import PreciseCache
from qosgate.wire.kv_events import CacheChange, EngineBlocks, decode_batch, token_prefix
from qosgate.wire.prefix import chain, token_blocks
from qosgate.wire.tokenize import token_ids, tokenize_request

BS = 4


def stored(hashes: list[Any], parent: Any, tokens: list[int], **kw: Any) -> dict[str, Any]:
    """A ``BlockStored`` as vLLM encodes it (a tagged map; defaults omitted)."""
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": BS, "lora_id": None, "medium": "GPU",
            "lora_name": None, **kw}


def removed(hashes: list[Any]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def batch(*events: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode([1.5, list(events)])


PROMPT = list(range(100, 114))  # 3 whole blocks and 2 tokens


def test_stored_blocks_get_the_keys_a_request_with_those_tokens_gets() -> None:
    eb = EngineBlocks()
    # the engine stores the first block, then two more under it (its hashes are its own)
    ch = eb.apply(decode_batch(batch(stored([b"h1"], None, PROMPT[:4]))))
    ch += eb.apply(decode_batch(batch(stored([b"h2", 7], b"h1", PROMPT[4:12]))))
    keys = token_prefix(PROMPT, BS).keys
    assert len(keys) == 3
    assert [k for c in ch for k in c.stored] == list(keys)
    assert eb.block_size == BS
    # another prompt sharing the first 5 tokens shares the first block's key only
    other = token_prefix([*PROMPT[:5], 1, 2, 3, 4, 5, 6, 7], BS).keys
    assert other[0] == keys[0] and other[1] != keys[1]


def test_removed_and_cleared_name_our_keys() -> None:
    eb = EngineBlocks()
    eb.apply(decode_batch(batch(stored([1, 2, 3], None, PROMPT[:12]))))
    keys = chain(token_blocks(PROMPT[:12], BS))
    [ch] = eb.apply(decode_batch(batch(removed([3, 99]))))
    assert ch == CacheChange(removed=[keys[2]])
    # a block stored then removed in one batch is neither; a clear starts a new change
    changes = eb.apply(decode_batch(batch(
        stored([4], 2, PROMPT[8:12]), removed([4]), {"type": "AllBlocksCleared"},
        stored([5], None, PROMPT[:4]),
    )))
    assert changes == [CacheChange(stored=[keys[0]], cleared=True)]
    assert eb.keys == {5: keys[0]}


def test_blocks_that_cannot_be_keyed_are_skipped_not_guessed() -> None:
    eb = EngineBlocks()
    [ch] = eb.apply(decode_batch(batch(
        stored([1], 42, PROMPT[:4]),  # a parent never seen
        stored([2], None, PROMPT[:4], lora_name="adapter"),  # not the base model's block
        stored([3], None, PROMPT[:4], extra_keys=[["salt"]]),  # a cache salt / media
        {"type": "SomethingNew", "x": 1},  # a later vLLM's event: left out
    )))
    assert ch.stored == [] and ch.skipped == 3 and eb.keys == {}


def test_tokenize_request_keeps_what_renders_the_prompt() -> None:
    chat = (b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": true,'
            b' "max_tokens": 5, "chat_template_kwargs": {"x": 1}}')
    got = msgspec.json.decode(tokenize_request(chat, "chat"))  # type: ignore[arg-type]
    assert got == {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                   "chat_template_kwargs": {"x": 1}}
    assert tokenize_request(b'{"model": "m", "prompt": [5, 6, 7]}', "completions") == [5, 6, 7]
    assert msgspec.json.decode(
        tokenize_request(b'{"prompt": ["one"], "n": 2}', "completions")  # type: ignore[arg-type]
    ) == {"prompt": "one"}
    assert tokenize_request(b'{"prompt": ["a", "b"]}', "completions") is None
    assert tokenize_request(b"[1]", "chat") is None
    assert token_ids(b'{"count": 2, "tokens": [1, 2], "max_model_len": 9}') == [1, 2]
    assert token_ids(b'{"error": "no"}') is None


def test_feed_follows_a_publisher_and_clears_when_its_sequence_restarts() -> None:
    pytest.importorskip("zmq")
    asyncio.run(asyncio.wait_for(_feed_scenario(), 30))


async def _feed_scenario() -> None:
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    changes: list[CacheChange] = []
    got = asyncio.Event()

    def on_change(c: CacheChange) -> None:
        changes.append(c)
        got.set()

    feed = KVEventFeed("r0", f"tcp://127.0.0.1:{port}", on_change, topic="kv")
    feed.start()
    seq = 0

    async def publish(payload: bytes, topic: bytes = b"kv") -> None:
        nonlocal seq
        await pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
        seq += 1

    try:
        # PUB/SUB: what is sent before the subscription is in place is dropped, so publish the
        # first block until it arrives (re-stored blocks are the same key)
        first = batch(stored([1], None, PROMPT[:4]))
        while not got.is_set():
            await publish(first)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(got.wait(), 0.05)
        keys = token_prefix(PROMPT, BS).keys
        assert changes[0].stored == [keys[0]]
        n = len(changes)
        got.clear()
        await publish(b"not msgpack", topic=b"other")  # another topic: not even received
        await publish(batch(stored([2], 1, PROMPT[4:8])))
        await asyncio.wait_for(got.wait(), 5)
        assert changes[n:] == [CacheChange(stored=[keys[1]])]
        assert feed.garbled == 0
        # the engine started again: numbered from 0, its cache empty
        got.clear()
        seq = 0
        await publish(batch(stored([9], None, PROMPT[:4])))
        await asyncio.wait_for(got.wait(), 5)
        while len(changes) < n + 3:
            got.clear()
            await asyncio.wait_for(got.wait(), 5)
        assert changes[n + 1:] == [CacheChange(cleared=True), CacheChange(stored=[keys[0]])]
        assert feed.restarts == 1 and feed.blocks.keys == {9: keys[0]}
    finally:
        await feed.close()
        pub.close(linger=0)
        ctx.term()


class FakeTokenizer:
    """A replica's ``/tokenize`` as ``PreciseCache`` sees it: ids, or None (failed, timed out)."""

    def __init__(self, ids: list[int] | None, ready: bool = True) -> None:
        self.ids = ids
        self.ready = ready
        self.asked: list[bytes] = []

    def models(self) -> list[str]:
        return ["m"]

    async def tokenize(self, request: bytes) -> list[int] | None:
        self.asked.append(request)
        return self.ids


def test_precise_keys_come_from_the_engines_token_ids_else_none() -> None:
    chat = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'

    def cache(tok: FakeTokenizer, block: int | None) -> PreciseCache:
        feed = KVEventFeed("r0", "tcp://127.0.0.1:9", lambda c: None)
        feed.blocks.block_size = block
        return PreciseCache({"r0": (feed, tok)})

    tok = FakeTokenizer(PROMPT)
    assert asyncio.run(cache(tok, BS).prefix_of(chat, "chat", "m")) == token_prefix(PROMPT, BS)
    # a token-id prompt is keyed as it is, without asking the engine
    ids = b'{"model": "m", "prompt": [100, 101, 102, 103, 104]}'
    assert asyncio.run(cache(tok, BS).prefix_of(ids, "completions", "m")) == token_prefix(
        PROMPT[:5], BS)
    assert len(tok.asked) == 1
    # the text's keys stay: the engine's block size not known yet, the replica down, another
    # model, the call failed (its timeout is the engine's: OpenAIUpstream.tokenize)
    assert asyncio.run(cache(tok, None).prefix_of(chat, "chat", "m")) is None
    assert asyncio.run(cache(FakeTokenizer(PROMPT, False), BS).prefix_of(chat, "chat", "m")) \
        is None
    assert asyncio.run(cache(tok, BS).prefix_of(chat, "chat", "other")) is None
    failing = cache(FakeTokenizer(None), BS)
    assert asyncio.run(failing.prefix_of(chat, "chat", "m")) is None
    assert failing.fallbacks == 1 and failing.tokenized == 0
