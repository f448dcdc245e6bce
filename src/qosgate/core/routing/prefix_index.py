"""Which prompt blocks each replica's prefix cache holds: an approximate per-replica index.

Approximate mode learns from where requests were sent: a prompt placed on a replica leaves its
blocks there. The engine evicts least recently used blocks once its cache is full, so each
replica's index is an LRU bounded by an estimate of that cache in blocks; a prompt's blocks are
touched last one first, so that within a prompt the tail goes before the head, as vLLM frees a
sequence's blocks (a chain with its head evicted matches nothing). Precise mode (a replica whose
engine publishes its KV events) follows only those events.

``match`` walks a prompt's chain from its first key until the first miss: a key stands for its
block *and* every block before it, so the leading run is all that can be cached. Its cost is the
keys matched (plus one), per replica.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from qosgate.core.prefix import Prefix


class BlockLru:
    """One replica's cached block keys, least recently used first, at most ``capacity``."""

    __slots__ = ("_keys", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def touch(self, keys: Sequence[int]) -> None:
        """``keys`` (one prompt's chain, in order) were used now: the head ends most recent."""
        held = self._keys
        for key in reversed(keys):
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
        while len(held) > self.capacity:
            held.popitem(last=False)

    def store(self, keys: Iterable[int]) -> None:
        """The engine says it stored ``keys`` (precise mode): no capacity but the engine's."""
        held = self._keys
        for key in keys:
            held[key] = None
            held.move_to_end(key)

    def remove(self, keys: Iterable[int]) -> None:
        held = self._keys
        for key in keys:
            held.pop(key, None)

    def clear(self) -> None:
        self._keys.clear()

    def leading(self, keys: Sequence[int]) -> int:
        """How many of ``keys``, from the first, are held (stops at the first miss)."""
        held = self._keys
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n


class PrefixIndex:
    """Per replica, the block keys it is believed to hold; ``capacity_tokens`` bounds each
    learned (approximate) replica's index by its cache's size in tokens."""

    __slots__ = ("_precise", "_replicas", "capacity_tokens")

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._replicas: dict[str, BlockLru] = {}
        self._precise: set[str] = set()  # replicas that follow their engine's events only

    def follow_events(self, name: str) -> None:
        """``name``'s index follows its engine's KV events from now on, not routing guesses."""
        self._precise.add(name)

    def _lru(self, name: str, block_tokens: int) -> BlockLru:
        lru = self._replicas.get(name)
        if lru is None:
            lru = self._replicas[name] = BlockLru(self.capacity_tokens // max(1, block_tokens))
        return lru

    def placed(self, name: str, prefix: Prefix) -> None:
        """A prompt went to ``name``: its blocks are (or will be) cached there."""
        if name not in self._precise and prefix.keys:
            self._lru(name, prefix.block_tokens).touch(prefix.keys)

    def observe(self, name: str, stored: Sequence[int], removed: Sequence[int],
                cleared: bool) -> None:
        """The engine's own KV events for ``name`` (precise mode; ignored for a replica
        whose index is learned from placements)."""
        if name not in self._precise:
            return
        lru = self._replicas.get(name)
        if lru is None:
            lru = self._replicas[name] = BlockLru(1 << 62)  # bounded by the engine's events
        if cleared:
            lru.clear()
        lru.remove(removed)
        lru.store(stored)

    def lost(self, name: str) -> None:
        """``name``'s cache is gone (it died, restarted, went down)."""
        lru = self._replicas.get(name)
        if lru is not None:
            lru.clear()

    def match(self, name: str, prefix: Prefix) -> int:
        """Leading blocks of ``prefix`` ``name`` is believed to hold."""
        lru = self._replicas.get(name)
        return 0 if lru is None else lru.leading(prefix.keys)

    def blocks(self, name: str) -> int:
        """Blocks indexed for ``name``."""
        lru = self._replicas.get(name)
        return 0 if lru is None else len(lru)
