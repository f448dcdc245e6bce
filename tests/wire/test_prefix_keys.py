"""Prefix keys at the wire (``wire.prefix``): shared prefixes share keys exactly up to their
shared full blocks, different prompts never share a key past where they differ, two spellings
of one conversation meet, token-id prompts, media parts; and the engine's cached tokens read
from its usage."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.core.prefix import common_blocks
from qosgate.runtime.upstream.relay import usage_counts
from qosgate.server.auth import MAX_SESSION_CHARS, session_id
from qosgate.wire.parse import parse_body
from qosgate.wire.prefix import (
    TEXT_BLOCK_CHARS,
    TOKEN_BLOCK,
    body_context,
    body_prefix,
    canonical_messages,
    chain,
    request_prefix,
    token_blocks,
)

SYSTEM = {"role": "system", "content": "You are terse. " * 100}


def keys(messages: list[dict[str, Any]], **body: Any) -> tuple[int, ...]:
    p = request_prefix(json.dumps(messages).encode(), context=body_context(
        json.dumps({"messages": messages, **body}).encode()))
    return p.keys if p is not None else ()


def test_a_next_turn_extends_the_previous_turns_keys() -> None:
    turn1 = [SYSTEM, {"role": "user", "content": "What is a prefix cache? " * 30}]
    turn2 = [*turn1, {"role": "assistant", "content": "A cache of KV blocks."},
             {"role": "user", "content": "And routing? " * 40}]
    k1, k2 = keys(turn1), keys(turn2)
    assert len(k1) == len(canonical_messages(json.dumps(turn1).encode())) // TEXT_BLOCK_CHARS
    assert len(k2) > len(k1) > 0
    assert k2[:len(k1)] == k1  # every full block of turn 1 is a block of turn 2


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.text(min_size=0, max_size=3000), st.text(min_size=1, max_size=1500),
       st.text(min_size=1, max_size=1500))
def test_shared_keys_are_exactly_the_shared_full_blocks(head: str, a: str, b: str) -> None:
    ma = [SYSTEM, {"role": "user", "content": head + a}]
    mb = [SYSTEM, {"role": "user", "content": head + b}]
    ca, cb = (canonical_messages(json.dumps(m).encode()) for m in (ma, mb))
    same = next((i for i, (x, y) in enumerate(zip(ca, cb, strict=False)) if x != y),
                min(len(ca), len(cb)))
    ka, kb = keys(ma), keys(mb)
    shared = same // TEXT_BLOCK_CHARS
    if ca == cb:
        assert ka == kb
    else:
        assert common_blocks(ka, kb) == min(shared, len(ka), len(kb))
        assert not set(ka[shared:]) & set(kb[shared:])  # nothing past the difference meets


def test_different_system_prompts_share_nothing() -> None:
    user = {"role": "user", "content": "x" * 4000}
    other = {"role": "system", "content": "You are verbose. " * 100}
    assert not set(keys([SYSTEM, user])) & set(keys([other, user]))
    # the same text as a completions prompt lives in a space of its own
    text = json.dumps(SYSTEM["content"] * 3).encode()
    p = request_prefix(prompt=text)
    assert p is not None and not set(p.keys) & set(keys([SYSTEM, user]))


def test_two_spellings_of_one_conversation_meet() -> None:
    msgs = [SYSTEM, {"role": "user", "content": "café " * 300}]
    compact = json.dumps(msgs, ensure_ascii=False, separators=(",", ":")).encode()
    spaced = json.dumps([{"content": m["content"], "role": m["role"]} for m in msgs],
                        indent=2).encode()  # other key order, whitespace, \u00e9 escapes
    a, b = request_prefix(compact), request_prefix(spaced)
    assert a is not None and a == b


def test_every_rendered_member_and_message_member_counts() -> None:
    msgs = [SYSTEM, {"role": "user", "content": "x" * 2000}]
    base = keys(msgs)
    assert keys(msgs, tools=[{"type": "function", "function": {"name": "f"}}])[0] != base[0]
    assert keys(msgs, chat_template_kwargs={"enable_thinking": False})[0] != base[0]
    assert keys(msgs, tools=None) == base  # null: as absent
    # a message's other members come before its content: a different role or name is a
    # different prompt from the message on
    cut = len(json.dumps(SYSTEM)) // 512
    for other in ({"role": "assistant"}, {"role": "user", "name": "bob"}):
        changed = keys([SYSTEM, {**other, "content": "x" * 2000}])
        assert changed[:cut] == base[:cut]
        assert not set(changed[cut + 1:]) & set(base)


def test_media_parts_count_by_their_identity() -> None:
    def msg(url: str) -> list[dict[str, Any]]:
        return [SYSTEM, {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": "describe it " * 100}]}]

    data = "data:image/png;base64," + "A" * 200_000
    a, b, c = keys(msg(data)), keys(msg(data)), keys(msg("https://x/cat.png"))
    assert a == b
    cut = len(json.dumps(SYSTEM)) // TEXT_BLOCK_CHARS  # blocks before the image
    assert a[:cut] == c[:cut] and a[cut:] != c[cut:]
    assert len(a) < 10  # an inline image is its digest, not 200 KB of blocks


def test_token_id_prompts_and_batches() -> None:
    ids = list(range(1000, 1000 + 5 * TOKEN_BLOCK + 3))
    p = request_prefix(prompt=json.dumps(ids).encode())
    assert p is not None and p.block_tokens == TOKEN_BLOCK
    assert p.keys == chain(token_blocks(ids, TOKEN_BLOCK))  # the engine's own block space
    assert len(p.keys) == 5  # the partial last block has no key
    other = request_prefix(prompt=json.dumps(ids[:2 * TOKEN_BLOCK] + [7] * 40).encode())
    assert other is not None and common_blocks(p.keys, other.keys) == 2
    assert request_prefix(prompt=json.dumps(ids[:TOKEN_BLOCK - 1]).encode()) is None
    # a batch: its first prompt's keys
    first = "a" * (3 * TEXT_BLOCK_CHARS)
    batch = request_prefix(prompt=json.dumps([first, "b"]).encode())
    assert batch == request_prefix(prompt=json.dumps(first).encode())
    assert request_prefix(prompt=json.dumps([ids, [1, 2]]).encode()) == p


def test_short_prompts_have_no_keys_and_the_parser_feeds_the_same_keys() -> None:
    assert request_prefix(b'[{"role":"user","content":"hi"}]') is None
    body = json.dumps({"model": "m", "messages": [SYSTEM], "tools": [{"a": 1}]}).encode()
    b = parse_body(body, "chat")
    assert body_prefix(b) == request_prefix(json.dumps([SYSTEM]).encode(),
                                            context=body_context(body))
    assert body_prefix(b) is not None


def test_cached_tokens_are_read_from_the_usage() -> None:
    with_details = (b'data: {"choices":[],"usage":{"prompt_tokens":300,"total_tokens":310,'
                    b'"completion_tokens":10,"prompt_tokens_details":{"cached_tokens":256}}}')
    assert usage_counts(with_details) == (10, 300, 256)
    assert usage_counts(b'{"usage":{"prompt_tokens":3,"completion_tokens":1}}') == (1, 3, None)


def test_session_ids() -> None:
    assert session_id(b" conv-42 ") == "conv-42"
    assert session_id("a b") == "a b"
    assert session_id(b"x" * MAX_SESSION_CHARS) is not None
    for bad in (b"", b"   ", b"x" * (MAX_SESSION_CHARS + 1), b"caf\xe9", b"a\tb", "日本"):
        assert session_id(bad) is None, bad
