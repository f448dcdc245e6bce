"""An engine's prefix cache, modelled on vLLM's automatic prefix caching.

Why this shape: vLLM keeps the KV of every full prompt block it computed, keyed by a chained
block hash. Blocks that a running sequence uses are *pinned* (reference counted): they cannot be
evicted. When the last sequence using a block lets go of it, the block stays cached but goes on
a free queue in release order; a new allocation takes the least recently released block first.
So the cached-but-free blocks are an LRU bounded by the KV the running sequences do not hold.

Here a block is its key (``core.prefix.Prefix.keys``) and the tokens it stands for; nothing of
the KV itself. Every operation is O(keys touched): a lookup walks the leading run it finds, a
trim pops from the LRU's cold end.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    """Cached blocks: pinned ones (refcounted) and unpinned ones in an LRU (coldest first)."""

    __slots__ = ("_lru", "_pins", "lru_tokens")

    def __init__(self) -> None:
        self._pins: dict[int, int] = {}  # key -> sequences holding it
        self._lru: OrderedDict[int, int] = OrderedDict()  # unpinned key -> its tokens
        self.lru_tokens = 0  # tokens of the unpinned cached blocks

    def __len__(self) -> int:
        """Cached blocks, pinned or not."""
        return len(self._pins) + len(self._lru)

    def __contains__(self, key: int) -> bool:
        return key in self._pins or key in self._lru

    @property
    def pinned(self) -> int:
        """Blocks some sequence holds."""
        return len(self._pins)

    def lookup(self, keys: Sequence[int], max_blocks: int) -> int:
        """How many leading ``keys`` (at most ``max_blocks``) are cached; touches nothing (as
        vLLM's lookup: a block is taken only when the sequence is admitted, by ``pin``)."""
        pins, lru = self._pins, self._lru
        n = 0
        for key in keys:
            if n >= max_blocks or (key not in pins and key not in lru):
                break
            n += 1
        return n

    def pin(self, keys: Sequence[int]) -> None:
        """A sequence holds these blocks (cached already, or cached now that it computed them)."""
        pins, lru = self._pins, self._lru
        for key in keys:
            held = pins.get(key)
            if held is not None:
                pins[key] = held + 1
                continue
            tokens = lru.pop(key, None)
            if tokens is not None:
                self.lru_tokens -= tokens
            pins[key] = 1

    def unpin(self, keys: Sequence[int], block_tokens: int) -> None:
        """A sequence lets go of these blocks. The last holder's release puts a block in the
        LRU, the sequence's tail first (vLLM frees in reverse so a tail goes before its head)."""
        pins, lru = self._pins, self._lru
        for key in reversed(keys):
            held = pins[key]
            if held > 1:
                pins[key] = held - 1
                continue
            del pins[key]
            lru[key] = block_tokens
            self.lru_tokens += block_tokens

    def touch(self, keys: Sequence[int], block_tokens: int) -> None:
        """Cache these blocks unpinned, most recently used, the head last (so it outlives the
        tail, as ``unpin`` orders a release); a pinned key stays pinned. Bound with ``trim``."""
        pins, lru = self._pins, self._lru
        for key in reversed(keys):
            if key in pins:
                continue
            if key in lru:
                lru.move_to_end(key)
                continue
            lru[key] = block_tokens
            self.lru_tokens += block_tokens

    def trim(self, bound_tokens: int) -> int:
        """Evict the coldest unpinned blocks until they fit in ``bound_tokens``; how many."""
        lru = self._lru
        n = 0
        while self.lru_tokens > bound_tokens and lru:
            _, tokens = lru.popitem(last=False)
            self.lru_tokens -= tokens
            n += 1
        return n
