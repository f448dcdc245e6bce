"""Prefix identity at the wire: a request's prompt as a chain of block keys (``core.prefix``).

Each key hashes one fixed-size block together with the key before it, so two prompts share
keys exactly as long as they share blocks from the start, and the core compares prompts by
comparing integers. ``chain`` is the one hash every key source uses (request bodies here, an
engine's KV-cache events in the runtime), so keys from different sources meet in one space.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from hashlib import blake2b

_ROOT = b"qosgate-prefix-v1"


def chain(blocks: Iterable[bytes], parent: int | None = None) -> tuple[int, ...]:
    """One 64-bit key per block, each over the key before it (``parent`` before the first)."""
    keys: list[int] = []
    prev = _ROOT if parent is None else parent.to_bytes(8, "little")
    for block in blocks:
        h = blake2b(prev, digest_size=8)
        h.update(block)
        prev = h.digest()
        keys.append(int.from_bytes(prev, "little"))
    return tuple(keys)


def token_blocks(ids: Sequence[int], block: int) -> list[bytes]:
    """Token ids cut into full blocks of ``block`` ids, each as bytes (a partial last block
    is left out: an engine caches whole blocks only)."""
    return [
        b"".join(i.to_bytes(4, "little", signed=False) for i in ids[k:k + block])
        for k in range(0, len(ids) - block + 1, block)
    ]
