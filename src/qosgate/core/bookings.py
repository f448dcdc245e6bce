"""Room admission keeps for refused requests whose clients come back when told.

A refusal's Retry-After is only true if a client that comes back then is admitted. Under
overload the queue stays at admission's edge: a client told "in a second" comes back to a queue
as full as before, and every client told the same second comes back together. So when
admission refuses a request it will know again (``Request.retry_key``: the I/O layer's
fingerprint of its tenant and body), it *books* it:

- the booking's time is when room for one more request of its class is forecast, and never
  sooner than one of its class's service intervals after the class's last booking: returns are
  spread at the rate the class's queue drains, not all in one second;
- until it is taken or lapses, a booking counts in the queue ahead of every new request of its
  class, weighed by the share of bookings that were taken lately (``returning``): the room is
  kept for the clients that come back, and not for those that never do (a client that gives up
  at its first refusal must not keep the others out);
- a client that comes back from its booking's time on takes it, and is admitted if its
  forecast holds; one that never comes back holds the room until ``grace`` after its time.

Nothing is booked past a class's horizon (its TTFT budget, at least the minimum Retry-After):
a Retry-After longer than a class's own budget tells its client nothing useful. Past it, the
refusal names the horizon, unbooked: a lower bound, not a promise.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

_EARLY_S = 0.1  # a return this much before its booking's time still takes it
_KEEP = 0.97  # how much of what bookings did each ended booking keeps (a few dozen remembered)


@dataclass(slots=True)
class _Booking:
    key: str
    level: int
    due: float
    lapses: float
    live: bool = True


class Bookings:
    """The bookings of every class, by key. One key may hold several: identical requests of one
    tenant (a load test's, a retried batch's) are told apart by nothing, and any of their
    returns takes the earliest of their bookings: they are alike, so is the room."""

    __slots__ = ("_by_key", "_held", "_lapse_heap", "_last", "_returned", "kept", "lapsed",
                 "made")

    def __init__(self, levels: int) -> None:
        self._by_key: dict[str, deque[_Booking]] = {}
        self._held = [0] * levels
        self._last = [-math.inf] * levels  # each class's latest booking time
        self._lapse_heap: list[tuple[float, int, _Booking]] = []
        self.made = 0
        self.kept = 0
        self.lapsed = 0
        # of the bookings that ended lately, taken (decayed) and all: what ``returning`` reads
        self._returned = (0.0, 0.0)

    def held(self, level: int, now: float) -> float:
        """The room kept for class ``level``: its bookings neither taken nor lapsed, times the
        share of bookings lately taken."""
        if self._lapse_heap and self._lapse_heap[0][0] <= now:
            self._lapse(now)
        held = self._held[level]
        return held * self.returning if held else 0.0

    @property
    def returning(self) -> float:
        """The share of the last few dozen bookings that were taken (a half before any
        ended)."""
        taken, ended = self._returned
        return (taken + 1.0) / (ended + 2.0)

    def take(self, key: str, now: float) -> bool:
        """A request with ``key`` arrived: True if it takes a booking of its key whose time
        has come (the earliest), which no longer holds room."""
        queue = self._by_key.get(key)
        if not queue:
            return False
        if self._lapse_heap and self._lapse_heap[0][0] <= now:
            self._lapse(now)
            if not queue:
                return False
        b = queue[0]
        if now < b.due - _EARLY_S:
            return False
        self._drop(b)
        self.kept += 1
        self._ended(True)
        return True

    def book(self, key: str, level: int, now: float, earliest: float, gap: float,
             horizon: float, grace: float) -> float | None:
        """Book ``key`` (class ``level``) for ``earliest`` or one ``gap`` after the class's
        last booking, whichever is later: the booking's time, or None if that is more than
        ``horizon`` from ``now`` (nothing is booked)."""
        due = max(earliest, self._last[level] + gap, now)
        if due - now > horizon:
            return None
        b = _Booking(key, level, due, due + grace)
        self._by_key.setdefault(key, deque()).append(b)
        self._held[level] += 1
        self._last[level] = due
        self.made += 1
        heapq.heappush(self._lapse_heap, (b.lapses, self.made, b))
        return due

    def _ended(self, taken: bool) -> None:
        kept, ended = self._returned
        self._returned = (kept * _KEEP + taken, ended * _KEEP + 1.0)

    def _drop(self, b: _Booking) -> None:
        """``b`` no longer holds room (taken or lapsed)."""
        b.live = False
        self._held[b.level] -= 1
        queue = self._by_key[b.key]
        queue.remove(b)
        if not queue:
            del self._by_key[b.key]

    def _lapse(self, now: float) -> None:
        heap = self._lapse_heap
        while heap and heap[0][0] <= now:
            b = heapq.heappop(heap)[2]
            if b.live:
                self._drop(b)
                self.lapsed += 1
                self._ended(False)
