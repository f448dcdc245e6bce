"""Which LoRA adapters a replica holds loaded: what its engine last said, and what was sent since.

The scrape is the engine's word (``LoadSignals.adapters``, most recently used first) but it lags
by a scrape interval; the dispatches are this gateway's own and immediate. So an adapter counts
as loaded if the last scrape named it, or if a request for it was sent there since the scrape
before that one (the scrape may have been read before the engine saw it). Both are cut to the
engine's capacity, most recent first, as the engine evicts the least recently used; until a scrape
says the capacity, one adapter is assumed (vLLM's default ``--max-loras``).
"""

from __future__ import annotations

from collections.abc import Sequence


class LoadedAdapters:
    """One replica's loaded adapters, most recently used last (``holds``, ``sent``,
    ``observe``)."""

    __slots__ = ("_order", "_sent", "_since", "capacity")

    def __init__(self) -> None:
        self.capacity = 1
        self._order: dict[str, None] = {}  # insertion order: least recently used first
        self._sent: dict[str, float] = {}  # adapter -> when a request for it was last sent
        self._since = float("-inf")  # when the scrape before the last was read

    def holds(self, adapter: str) -> bool:
        return adapter in self._order

    def full(self) -> bool:
        """Loading one more would evict one."""
        return len(self._order) >= self.capacity

    def names(self) -> tuple[str, ...]:
        """Most recently used first."""
        return tuple(reversed(self._order))

    def sent(self, adapter: str, now: float) -> None:
        """A request for ``adapter`` was sent to this replica: the engine loads it, if it had
        not, and it is the most recently used."""
        self._order.pop(adapter, None)
        self._order[adapter] = None
        self._sent[adapter] = now
        self._trim()

    def observe(self, loaded: Sequence[str], capacity: int | None, at: float) -> None:
        """The engine's scrape read at ``at``: ``loaded`` most recently used first."""
        if capacity is not None:
            self.capacity = max(1, capacity)
        recent = sorted((t, a) for a, t in self._sent.items() if t >= self._since)
        self._since = at
        self._sent = dict((a, t) for t, a in recent)
        order: dict[str, None] = {a: None for a in reversed(loaded)}
        for _, adapter in recent:
            order.pop(adapter, None)
            order[adapter] = None
        self._order = order
        self._trim()

    def forget(self) -> None:
        """The engine restarted or went down: it holds nothing."""
        self._order.clear()
        self._sent.clear()

    def _trim(self) -> None:
        while len(self._order) > self.capacity:
            del self._order[next(iter(self._order))]
