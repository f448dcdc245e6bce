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
from dataclasses import dataclass

_EARLY_S = 0.1  # a return this much before its booking's time still takes it
_KEEP = 0.97  # how much of what bookings did each ended booking keeps (a few dozen remembered)


@dataclass(slots=True)
class _Booking:
    level: int
    due: float
    lapses: float


class Bookings:
    __slots__ = ("_by_key", "_held", "_lapse_heap", "_last", "_returned", "kept", "lapsed",
                 "made")

    def __init__(self, levels: int) -> None:
        self._by_key: dict[str, _Booking] = {}
        self._held = [0] * levels
        self._last = [-math.inf] * levels  # each class's latest booking time
        self._lapse_heap: list[tuple[float, str]] = []
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

    def _ended(self, taken: bool) -> None:
        kept, ended = self._returned
        self._returned = (kept * _KEEP + taken, ended * _KEEP + 1.0)

    def take(self, key: str, now: float) -> bool:
        """A request with ``key`` arrived: True if it takes its booking (it came back from its
        time on), which no longer holds room."""
        b = self._by_key.get(key)
        if b is None or now < b.due - _EARLY_S or now >= b.lapses:
            return False
        self._drop(key, b)
        self.kept += 1
        self._ended(True)
        return True

    def book(self, key: str, level: int, now: float, earliest: float, gap: float,
             horizon: float, grace: float) -> float | None:
        """Book ``key`` (class ``level``) for ``earliest`` or one ``gap`` after the class's
        last booking, whichever is later: the booking's time, or None if that is more than
        ``horizon`` from ``now`` (nothing is booked). A key booked already is booked again."""
        old = self._by_key.get(key)
        if old is not None:
            self._drop(key, old)
        due = max(earliest, self._last[level] + gap, now)
        if due - now > horizon:
            return None
        lapses = due + grace
        self._by_key[key] = _Booking(level, due, lapses)
        self._held[level] += 1
        self._last[level] = due
        heapq.heappush(self._lapse_heap, (lapses, key))
        self.made += 1
        return due

    def _drop(self, key: str, b: _Booking) -> None:
        del self._by_key[key]
        self._held[b.level] -= 1

    def _lapse(self, now: float) -> None:
        heap = self._lapse_heap
        while heap and heap[0][0] <= now:
            lapses, key = heapq.heappop(heap)
            b = self._by_key.get(key)
            if b is not None and b.lapses == lapses:  # (not one taken, or booked again)
                self._drop(key, b)
                self.lapsed += 1
                self._ended(False)
