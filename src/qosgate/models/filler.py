"""The simulated model's tokens: filler words whose ids follow from the sequence itself.

Why context-determined ids: a gateway that lost a stream continues it by sending the engine the
prompt's ids plus the ids it delivered, and on a greedy engine that continuation is exact. So a
token id here is a function of the two ids before it in the sequence (prompt ids, then generated
ones), never of a request id: generating n tokens, or k and then n - k from the prompt plus those
k ids, gives the same ids and the same text. A token's text is its word after a space, except
for the sequence's very first token (of a sequence without prompt ids, the simulator's): an
answer to a prompt, or to a continuation, then concatenates the same across such a split.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

_WORDS = (
    "the of and to in is that it was for on are as with his they at be this from have or by "
    "one had not but what all were when we there can an your which their said if do will "
    "each about how up out them then she many some so these would other into has more her "
    "two like him see time could no make than first been its who now people my made over did "
    "down only way find use may water long little very after words called just where most "
    "know"
)
VOCAB = tuple(_WORDS.split())
# what stands before a sequence's first id when its context is shorter than two ids
_NO_ID = -1

Context = tuple[int, int]


def text_ids(text: bytes) -> tuple[int, ...]:
    """A text prompt as ids: one per 4 bytes (a remainder joins no id), at least one, so the
    count is the estimate of prompt tokens used everywhere (characters / 4)."""
    n = max(1, len(text) // 4)
    return tuple(zlib.crc32(text[4 * i : 4 * i + 4]) % len(VOCAB) for i in range(n))


def context_of(ids: Sequence[int]) -> Context:
    """The two last ids of a sequence (the context the next id depends on)."""
    if len(ids) >= 2:
        return ids[-2], ids[-1]
    return _NO_ID, (ids[-1] if ids else _NO_ID)


def seeded_context(seq_id: str) -> Context:
    """A context for a sequence without prompt ids (the simulator's), from its id, so that its
    runs are deterministic across processes."""
    n = len(VOCAB)
    return zlib.crc32(f"{seq_id}:a".encode()) % n, zlib.crc32(f"{seq_id}:b".encode()) % n


def next_id(context: Context) -> int:
    """The id that follows ``context``."""
    return zlib.crc32(f"{context[0]},{context[1]}".encode()) % len(VOCAB)


def word(token_id: int, first: bool = False) -> str:
    """The text of ``token_id``: its word, after a space unless it is the sequence's ``first``."""
    w = VOCAB[token_id % len(VOCAB)]
    return w if first else " " + w
