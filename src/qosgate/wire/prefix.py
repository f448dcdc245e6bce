"""Prefix identity at the wire: a request's prompt as a chain of block keys (``core.prefix``).

Each key hashes one fixed-size block together with the key before it, so two prompts share
keys exactly as long as they share blocks from the start, and the core compares prompts by
comparing integers. ``chain`` is the one hash every key source uses (request bodies here, an
engine's KV-cache events in the runtime), so keys from different sources meet in one space.

``request_prefix`` derives a request's keys from the prompt as the engine will read it:

- chat ``messages``: decoded and written again in one canonical JSON form (keys sorted, the
  content last, no whitespace, one spelling of every string), so the same conversation sent by
  two clients -- one
  that escapes ``é`` and puts ``content`` before ``role``, one that does neither -- gets the
  same keys, and two different conversations can never share a key past the point where they
  differ (the canonical form is injective: different values, different bytes). The list's
  closing ``]`` is left out, so a conversation's next turn (the same messages and more) extends
  the bytes of the previous one. Every member of a message counts (``name``, ``tool_calls``,
  ...: the chat template renders them), and the request's members that the template renders
  too (``tools``, ``documents``, ``chat_template``, ...: ``parse.RENDERED``) seed the chain, so that
  the same messages under other tools share nothing. A content part that is not text (an
  image, an audio clip) stands as a digest of its reference (its canonical JSON: a URL, or the
  inline data): the same image, the same key; its size in the bytes is that of the digest;
- a ``prompt`` string: its UTF-8 text; a list of token ids: the ids in blocks of
  ``TOKEN_BLOCK`` (``token_blocks``, vLLM's block size, chained from the root as an engine's
  own block hashes would be); a batch (a list of prompts): the first prompt's keys (a batch's
  prompts are typically one template over several inputs: the first one's head is the head
  they share).

Hashing the decoded text rather than the raw JSON span costs one decode and one encode of the
messages (``bench/prefix_keys.py`` measures both); what it buys is that two clients' spellings
of one conversation meet, and that a key is never made of JSON punctuation that the engine
does not see. A partial last block has no key: an engine caches whole blocks only.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec
import xxhash

from qosgate.core.prefix import Prefix
from qosgate.wire.parse import CHARS_PER_TOKEN, RENDERED, Body

_xxh3 = xxhash.xxh3_64_intdigest
_ROOT_KEY = _xxh3(b"qosgate-prefix-v1")
# a block of canonical prompt bytes: ~128 tokens at the gateway's chars-per-token estimate;
# coarse enough that a 100 KB prompt is ~200 keys, fine enough that a new turn re-uses all but
# the last block of the previous one
TEXT_BLOCK_CHARS = 512
TOKEN_BLOCK = 16  # token-id prompts: vLLM's default block size


def chain(blocks: Iterable[bytes], parent: int | None = None) -> tuple[int, ...]:
    """One 64-bit key per block, each over the key before it (``parent`` before the first):
    XXH3-64 of the block seeded with the previous key. Not a cryptographic hash: a client that
    forges a collision only misleads the router's guess of where its prompt is cached (the
    engine hashes its own blocks), and XXH3 keys a request several times faster than blake2b
    (``bench/prefix_keys.py``)."""
    keys: list[int] = []
    prev = _ROOT_KEY if parent is None else parent
    for block in blocks:
        prev = _xxh3(block, seed=prev)
        keys.append(prev)
    return tuple(keys)


def token_blocks(ids: Sequence[int], block: int) -> list[bytes]:
    """Token ids cut into full blocks of ``block`` ids, each as bytes (a partial last block
    is left out: an engine caches whole blocks only)."""
    return [
        b"".join(i.to_bytes(4, "little", signed=False) for i in ids[k:k + block])
        for k in range(0, len(ids) - block + 1, block)
    ]


def byte_blocks(data: bytes, block: int) -> list[bytes]:
    """``data`` cut into full blocks of ``block`` bytes (the partial last one left out)."""
    return [data[k:k + block] for k in range(0, len(data) - block + 1, block)]


_canon = msgspec.json.Encoder(order="deterministic").encode  # every dict's keys sorted
_decode_any = msgspec.json.decode


def canonical_messages(span: bytes) -> bytes:
    """``messages`` in canonical JSON, without the list's closing bracket (see the module):
    each message as ``[its other members (keys sorted), its content]``, so that what a template
    renders before the content (the role, a name) comes before it here too: two messages that
    differ there differ before their content does. b"" for a value the parser would refuse."""
    msgs = _decode_any(span)
    if not isinstance(msgs, list):
        return b""
    out: list[Any] = []
    for m in msgs:
        if not isinstance(m, dict):
            out.append(m)
            continue
        content = m.pop("content", None)
        if isinstance(content, list):
            for i, part in enumerate(content):
                if isinstance(part, dict) and part.get("type", "text") != "text":
                    content[i] = {"type": part.get("type"), "ref": _media_ref(part)}
        out.append([m, content])
    return _canon(out)[:-1]


def _media_ref(part: dict[str, Any]) -> str:
    """A content part's identity: the digest of its canonical JSON (its URL or inline data)."""
    return xxhash.xxh3_128_hexdigest(_canon(part))


def rendered_context(members: Iterable[tuple[str, bytes]]) -> bytes:
    """The request members a chat template renders (``RENDERED``), as name and raw JSON, for
    ``request_prefix``'s ``context``; members absent or null leave no trace."""
    return b"".join(
        name.encode() + b"=" + raw + b"\x00"
        for name, raw in members if raw and raw != b"null"
    )


_Rendered = msgspec.defstruct(
    "_Rendered", [(name, msgspec.Raw, msgspec.Raw(b"")) for name in RENDERED])
_rendered_decoder = msgspec.json.Decoder(_Rendered)


def body_context(body: bytes) -> bytes:
    """``rendered_context`` of a whole body, for a server that does not read it with
    ``parse_body`` (the stand-in); b"" for a body that is not a JSON object."""
    try:
        r = _rendered_decoder.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return b""
    return rendered_context((name, bytes(getattr(r, name))) for name in RENDERED)


def body_prefix(b: Body) -> Prefix | None:
    """``request_prefix`` of a body as the gateway's parser read it."""
    return request_prefix(bytes(b.messages), bytes(b.prompt), rendered_context(b.rendered))


def request_prefix(
    messages: bytes = b"",
    prompt: bytes = b"",
    context: bytes = b"",
    *,
    block_chars: int = TEXT_BLOCK_CHARS,
    token_block: int = TOKEN_BLOCK,
) -> Prefix | None:
    """The request's block keys from its raw ``messages`` (chat) or ``prompt`` (completions)
    JSON, as the parser kept them (see the module); ``context``: ``rendered_context`` of the
    body. None when there is no full block (or no prompt the parser would accept)."""
    if messages:
        canon = canonical_messages(messages)
        seed = chain((b"chat\x00" + context,))[0]
        return _prefix(chain(byte_blocks(canon, block_chars), seed), block_chars)
    if not prompt:
        return None
    value = _decode_any(prompt)
    if isinstance(value, list):
        if not value:
            return None
        if not isinstance(value[0], int):  # a batch: its first prompt
            value = value[0]
    if isinstance(value, str):
        seed = chain((b"prompt\x00" + context,))[0]
        data = value.encode()
        return _prefix(chain(byte_blocks(data, block_chars), seed), block_chars)
    if isinstance(value, list) and all(type(i) is int and 0 <= i < 1 << 32 for i in value):
        return _prefix(chain(token_blocks(value, token_block)), 0, token_block)
    return None


def _prefix(keys: tuple[int, ...], block_chars: int, block_tokens: int = 0) -> Prefix | None:
    if not keys:
        return None
    return Prefix(keys, block_tokens or max(1, block_chars // CHARS_PER_TOKEN))
