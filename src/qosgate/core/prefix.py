"""A request's prefix identity as the core sees it: a chain of block keys, nothing of the text.

Two requests share their first ``n`` keys exactly when they share their first ``n`` blocks of
prompt (each key hashes its block *and* the key before it), so "how much of this prompt does a
replica hold" is "how long a leading run of these keys does it hold". Where the keys come from
is the I/O layers' business: the gateway hashes the request as the engine will see it
(``wire.prefix``), the simulator reads a trace's block ids.
"""

from __future__ import annotations

from typing import NamedTuple


class Prefix(NamedTuple):
    """``keys``: one per full block of the prompt, in order; ``block_tokens``: the prompt
    tokens each key stands for (an estimate where the gateway hashes text)."""

    keys: tuple[int, ...]
    block_tokens: int

    @property
    def tokens(self) -> int:
        """Prompt tokens the keys cover."""
        return len(self.keys) * self.block_tokens


def common_blocks(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """How many leading keys ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
