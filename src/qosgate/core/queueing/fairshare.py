"""Weighted fair share by virtual counters: one mechanism for class shares and tenant fairness.

A counter per key grows by (service cost / weight) each time the key is served; the backlogged key
with the smallest counter goes next. This is the Virtual Token Counter of Sheng et al., "Fairness in
Serving Large Language Models" (OSDI'24): when a key becomes backlogged its counter is lifted to the
smallest counter among the backlogged keys (or, with none backlogged, to the counter of the key that
left last), so idle time earns no credit and two backlogged keys never drift apart by more than
about one request's cost (the paper's bound is 2x the largest single request cost).

Service is charged when a request is dispatched, but an engine may still hold it in its own queue.
So a key that becomes backlogged is lifted no higher than just below the tag of the oldest request
still *held* (dispatched, not started): were those requests still queued here, the newcomer would
be picked before them, and the engine, which orders by these tags (``engine_order``), then starts
it before them too. The extra credit is bounded by what waits unstarted in the engines.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class FairShare(Generic[K]):
    """Counters for a set of keys, the backlogged ones kept in order: ``pick`` reads the first.

    ``_rows`` is a sorted list with one row per backlogged key, ``(counter, order, key)``, always
    at the key's current counter. Orders are unique (``rank``, or the order keys were first
    seen), so rows compare on ``(counter, order)`` alone: the first row is exactly the key with
    the least of them, and a key's row is found by bisection from its counter. A charge moves
    the key's row (a bisection, a deletion and an insertion, all in C; the list holds only the
    backlogged keys of one split, a few classes or the tenants waiting in one). A lazy heap,
    re-filing stale rows when they surfaced and retiring rows on every decrease, took three to
    four times the Python steps per pick, charge and settle.
    """

    __slots__ = ("_active", "_held", "_last_left", "_order", "_rank", "_rows", "_weight",
                 "counter", "lifted")

    def __init__(self, rank: Callable[[K], int] | None = None) -> None:
        # who goes first on equal counters: ``rank`` (lower first), else the first activated
        self._rank = rank
        self.counter: dict[K, float] = {}
        self._weight: dict[K, float] = {}
        self._order: dict[K, int] = {}
        # (counter, order, key) of each backlogged key, sorted
        self._rows: list[tuple[float, int, K]] = []
        self._active: set[K] = set()
        self._last_left = 0.0
        # what the lifts added to each counter: not service, so not for other instances to
        # merge (each lifts on its own; summed across instances, lifts starved a tenant)
        self.lifted: dict[K, float] = {}
        # tags of requests picked and not started yet: token -> tag. Only a lift asks for the
        # oldest (a key back from idle), every pop holds one and every start releases it: a
        # scan of the few held (those the engines have not started) on a lift costs less than
        # a heap kept in order on every pop
        self._held: dict[object, float] = {}

    def set_weight(self, key: K, weight: float) -> None:
        self._weight[key] = weight

    def activate(self, key: K, lift: bool = True) -> None:
        """``key`` became backlogged: lift it so idle time earns no credit (VTC). Without
        ``lift``: it was never idle (emptied only for a moment), and keeps its counter."""
        known = self.counter.get(key)
        c = 0.0 if known is None else known
        floor = (self._min_active() if self._active else self._last_left) if lift else c
        if lift and self._held:
            oldest = min(self._held.values())
            if oldest - 1.0 < floor:
                floor = oldest - 1.0  # just before it: a tie would go to the one held
        if known is None and lift:
            c = min(c, floor)  # a new key starts at the floor, whichever side of 0 it is
        if c < floor:
            self.lifted[key] = self.lifted.get(key, 0.0) + (floor - c)
            c = floor
        if key in self._active:  # (already backlogged: its row moves)
            self._unfile(key)
        self.counter[key] = c
        if key not in self._order:
            self._order[key] = len(self._order) if self._rank is None else self._rank(key)
        self._active.add(key)
        insort(self._rows, (c, self._order[key], key))

    def deactivate(self, key: K) -> None:
        if key in self._active:
            self._active.discard(key)
            self._unfile(key)
        self._last_left = self.counter.get(key, 0.0)

    def charge(self, key: K, cost: float) -> None:
        """Account ``cost`` of service to ``key`` (negative corrects an over-estimate)."""
        counter = self.counter
        old = counter.get(key, 0.0)
        c = counter[key] = old + cost / self._weight.get(key, 1.0)
        if c != old and key in self._active:
            rows = self._rows  # (``_move``, inline: every completion settles twice)
            order = self._order[key]
            del rows[bisect_left(rows, (old, order))]
            insort(rows, (c, order, key))

    def merge(self, key: K, delta: float) -> None:
        """Add service accounted elsewhere (another gateway instance's, already weighted)."""
        counter = self.counter
        old = counter.get(key, 0.0)
        c = counter[key] = old + delta
        if c != old and key in self._active:
            self._move(key, old, c)

    def pick(self) -> K | None:
        """The backlogged key with the least weighted service, or None."""
        rows = self._rows
        return rows[0][2] if rows else None

    def release(self, token: object) -> None:
        """It started (or left without starting): its tag no longer bounds a lift."""
        self._held.pop(token, None)

    def _min_active(self) -> float:
        rows = self._rows
        return rows[0][0] if rows else self._last_left

    def _move(self, key: K, old: float, c: float) -> None:
        """A backlogged key's counter went from ``old`` to ``c``: its row follows."""
        rows = self._rows
        order = self._order[key]
        del rows[bisect_left(rows, (old, order))]
        insort(rows, (c, order, key))

    def _unfile(self, key: K) -> None:
        """Take a backlogged key's row out (its counter is the one its row shows)."""
        rows = self._rows
        del rows[bisect_left(rows, (self.counter[key], self._order[key]))]
