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

from collections.abc import Callable, Hashable
from heapq import heapify, heappop, heappush, heapreplace
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class FairShare(Generic[K]):
    """Counters for a set of keys; O(log k) activate/charge/pick for k backlogged keys.

    The heap holds one live row per backlogged key, ``(counter, order, version, key)``. A row may
    show a counter *lower* than the key's current one: charging only raises the counter, and
    ``pick`` re-files a row whose counter is out of date before trusting the top, so the common
    charge costs no heap operation at all. (The top row then shows the least counter: every
    other row shows no more than its key's, and orders are unique, so ``pick`` is exactly the
    backlogged key with the least ``(counter, order)``, however the rows were filed.) A
    *decrease* (a refund or a correction downwards) could hide a key under others, so it files a
    fresh row and retires the old one (version).
    """

    __slots__ = ("_active", "_heap", "_heap_cap", "_held", "_last_left", "_order", "_rank",
                 "_version", "_weight", "counter", "lifted")

    def __init__(self, rank: Callable[[K], int] | None = None) -> None:
        # who goes first on equal counters: ``rank`` (lower first), else the first activated
        self._rank = rank
        self.counter: dict[K, float] = {}
        self._weight: dict[K, float] = {}
        self._version: dict[K, int] = {}
        self._order: dict[K, int] = {}
        # (counter, order, version, key): order makes ties deterministic; version marks stale rows
        self._heap: list[tuple[float, int, int, K]] = []
        self._heap_cap = 64  # past this many rows, the retired ones are dropped (O(keys))
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
        self.counter[key] = c
        if key not in self._order:
            self._order[key] = len(self._order) if self._rank is None else self._rank(key)
            self._heap_cap = 4 * len(self._order) + 64
        self._active.add(key)
        self._push(key)

    def deactivate(self, key: K) -> None:
        self._active.discard(key)
        self._version[key] = self._version.get(key, 0) + 1  # its row is stale from now on
        self._last_left = self.counter.get(key, 0.0)

    def charge(self, key: K, cost: float) -> None:
        """Account ``cost`` of service to ``key`` (negative corrects an over-estimate)."""
        self.counter[key] = self.counter.get(key, 0.0) + cost / self._weight.get(key, 1.0)
        if cost < 0 and key in self._active:
            self._push(key)

    def merge(self, key: K, delta: float) -> None:
        """Add service accounted elsewhere (another gateway instance's, already weighted)."""
        self.counter[key] = self.counter.get(key, 0.0) + delta
        if delta < 0 and key in self._active:
            self._push(key)

    def pick(self) -> K | None:
        """The backlogged key with the least weighted service, or None."""
        heap = self._heap
        version = self._version
        counter = self.counter
        while heap:
            c, order, v, key = heap[0]
            if v != version[key]:
                heappop(heap)  # a retired row
            elif c != counter[key]:
                heapreplace(heap, (counter[key], order, v, key))  # charged since filed
            else:
                return key
        return None

    def served(self, key: K, payer: K, cost: float, emptied: bool, token: object) -> float:
        """``key``, just picked, was served a request of ``cost``, paid by ``payer`` (an aged
        request may wait under another key than its own); ``emptied``: nothing of ``key`` waits
        now. With a ``token`` (not None) the counter it was picked at, its tag, is *held* until
        ``release(token)``: the request was dispatched and has not started yet. Returns the tag.
        (What ``pick``'s caller does with the key it got, in one call: every pop does it.)"""
        counter = self.counter
        tag = counter[key]
        if token is not None:
            self._held[token] = tag
        if emptied:
            self.deactivate(key)
        # ``charge``, inline
        c = counter[payer] = counter.get(payer, 0.0) + cost / self._weight.get(payer, 1.0)
        if payer == key and not emptied:
            # its row is on top (``pick`` just checked it): re-filed now, at its new counter,
            # the next ``pick`` can trust the top at once
            heap = self._heap
            _, order, v, _ = heap[0]
            heapreplace(heap, (c, order, v, key))
        elif cost < 0 and payer in self._active:
            self._push(payer)
        return tag

    def release(self, token: object) -> None:
        """It started (or left without starting): its tag no longer bounds a lift."""
        self._held.pop(token, None)

    def _min_active(self) -> float:
        key = self.pick()
        return self.counter[key] if key is not None else self._last_left

    def _push(self, key: K) -> None:
        v = self._version.get(key, 0) + 1
        self._version[key] = v
        heap = self._heap
        heappush(heap, (self.counter[key], self._order[key], v, key))
        if len(heap) > self._heap_cap:  # drop retired rows so memory stays O(k)
            live = [row for row in heap if row[2] == self._version[row[3]]]
            heapify(live)
            self._heap = live
