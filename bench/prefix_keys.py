"""What a request's prefix keys cost at the gateway (``wire.prefix.request_prefix``), once per
request: chat bodies of about 1 KB, 10 KB and 100 KB (a system prompt and a conversation of
turns), microseconds per request, best of 7 runs; the hash and the input compared in one run:

- ``canon+xxh3``: what the gateway does (decode the messages, write them again in canonical
  JSON, chain XXH3-64 over 512-byte blocks: ``request_prefix``);
- ``canon+blake2b``: the same with the standard library's blake2b (8-byte digest over the
  previous key and the block) in place of XXH3;
- ``raw+xxh3`` / ``raw+blake2b``: the raw ``messages`` JSON as the parser keeps it, with no
  canonical form (cheapest: no decode, but two spellings of one conversation never meet);
- ``canon only``: the decode and encode alone, no hash; ``parse_body``: the gateway's parse of
  the same body, for scale.

    PYTHONPATH=src .venv/bin/python bench/prefix_keys.py [--block 512]
"""

from __future__ import annotations

import argparse
import random
import timeit
from collections.abc import Callable, Iterable
from hashlib import blake2b

import msgspec

from qosgate.wire.parse import parse_body
from qosgate.wire.prefix import byte_blocks, canonical_messages, chain, request_prefix

WORDS = ("the", "of", "and", "to", "in", "is", "that", "for", "it", "as", "with", "on", "be",
         "tokens", "cache", "prefix", "replica", "engine", "request")


def conversation(size: int, rng: random.Random) -> bytes:
    """A chat body of about ``size`` bytes: a system prompt, then user/assistant turns."""
    def text(n: int) -> str:
        out: list[str] = []
        length = 0
        while length < n:
            w = rng.choice(WORDS)
            out.append(w)
            length += len(w) + 1
        return " ".join(out)

    msgs = [{"role": "system", "content": text(min(size // 4, 2000))}]
    role = "user"
    while len(msgspec.json.encode(msgs)) < size:
        msgs.append({"role": role, "content": text(min(600, size // 8))})
        role = "assistant" if role == "user" else "user"
    return msgspec.json.encode({"model": "m", "messages": msgs, "max_tokens": 16})


def chain_blake2b(blocks: Iterable[bytes]) -> tuple[int, ...]:
    """``chain`` as it would be with blake2b: each key over the previous key and the block."""
    keys: list[int] = []
    prev = b"qosgate-prefix-v1"
    for block in blocks:
        h = blake2b(prev, digest_size=8)
        h.update(block)
        prev = h.digest()
        keys.append(int.from_bytes(prev, "little"))
    return tuple(keys)


def best_us(fn: Callable[[], object], n: int) -> float:
    return min(timeit.repeat(fn, number=n, repeat=7)) / n * 1e6


def measure(body: bytes, raw: bytes, blk: int, n: int) -> list[float]:
    """The columns after ``keys``, in order."""
    return [
        best_us(lambda: request_prefix(raw, block_chars=blk), n),
        best_us(lambda: chain_blake2b(byte_blocks(canonical_messages(raw), blk)), n),
        best_us(lambda: chain(byte_blocks(raw, blk)), n),
        best_us(lambda: chain_blake2b(byte_blocks(raw, blk)), n),
        best_us(lambda: canonical_messages(raw), n),
        best_us(lambda: parse_body(body, "chat"), n),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--block", type=int, default=512, help="block size in bytes")
    args = ap.parse_args()
    rng = random.Random(7)
    blk = args.block
    print(f"block {blk} bytes; microseconds per request, best of 7")
    cols = ("body", "keys", "canon+xxh3", "canon+blake2b", "raw+xxh3", "raw+blake2b",
            "canon only", "parse_body")
    print(" ".join(f"{c:>13}" for c in cols))
    for size in (1_000, 10_000, 100_000):
        body = conversation(size, rng)
        raw = bytes(parse_body(body, "chat").messages)
        keys = request_prefix(raw, block_chars=blk)
        row = measure(body, raw, blk, max(20, 200_000 // size))
        head = f"{len(body):>13} {len(keys.keys) if keys else 0:>13} "
        print(head + " ".join(f"{v:>13.1f}" for v in row))
        print(f"{'':>27} blake2b/xxh3 on canonical: {row[1] / row[0]:.2f}x; "
              f"keys / parse_body: {row[0] / row[5]:.2f}x")


if __name__ == "__main__":
    main()
