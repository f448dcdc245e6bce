"""The simulator's external events: small typed records on one heap, ordered by time, then by
kind (``RANK``), then by a tie key within the kind.

Why a rank and not only a sequence number: at one instant the driver has always handled the
kinds in one order -- the end of the arrival span, a sample, a probe, a fault, a scheduler
timer, an arrival, a client's retry, a shared-state sync, then a batch job's (last, so a run
without jobs keeps its order) -- and every printed table depends on it. Within a kind the tie
key keeps each source's own order: faults in their sorted order, retries in the order they were
scheduled, syncs by gateway then by when they were scheduled.
Scheduler timers are not on the heap (each gateway's ``next_timer()`` moves with every fact it
is given); the driver compares the earliest one with the heap's top at rank ``TIMER_RANK``.
Engine events are not on it either: an engine's next event is found by advancing it, and it
goes before any external event at the same instant.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import ClassVar

from qosgate.core.shared import Exchange, StoreCall
from qosgate.sim.workload import Arrival

TIMER_RANK = 4


@dataclass(frozen=True, slots=True)
class ArrivalsEnd:
    """The end of the arrival span: the snapshot the arrival-span metrics are measured on."""

    RANK: ClassVar[int] = 0
    GATED: ClassVar[bool] = False


@dataclass(frozen=True, slots=True)
class SampleDue:
    RANK: ClassVar[int] = 1
    GATED: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class ProbeDue:
    RANK: ClassVar[int] = 2
    GATED: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class FaultDue:
    """A fault's action on a replica: ``die``, ``revive`` or ``slow`` (by ``factor``)."""

    action: str
    replica: str
    factor: float
    RANK: ClassVar[int] = 3
    GATED: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class ArrivalDue:
    """A workload arrival (its first attempt)."""

    arrival: Arrival
    RANK: ClassVar[int] = 5
    GATED: ClassVar[bool] = False


@dataclass(frozen=True, slots=True)
class RetryDue:
    """A refused request sent again by its client (its Retry-After is over)."""

    arrival: Arrival
    RANK: ClassVar[int] = 6
    GATED: ClassVar[bool] = False


@dataclass(frozen=True, slots=True)
class SyncDue:
    """A gateway's shared-state sync: a new one (``steps`` None), or the answer to the store
    call ``call`` of the one under way."""

    gateway: int
    steps: Exchange | None = None
    call: StoreCall | None = None
    RANK: ClassVar[int] = 7
    GATED: ClassVar[bool] = True


@dataclass(frozen=True, slots=True)
class JobDue:
    """A batch job's instant (``batches_feed.py``): ``open`` (submitted), ``expire`` (its window
    closes), ``line`` (a line's back-off or Retry-After is over) or ``feed`` (lines ended: the
    feeder looks for room, as the gateway's feeder wakes on a line's end)."""

    job: int
    action: str
    line: int = -1
    RANK: ClassVar[int] = 8
    GATED: ClassVar[bool] = False


Event = ArrivalsEnd | SampleDue | ProbeDue | FaultDue | ArrivalDue | RetryDue | SyncDue | JobDue


class EventHeap:
    """The pending external events. ``GATED`` kinds (samples, probes, faults, syncs) only
    matter while requests may still come or live: once none can (for good), they are dropped."""

    __slots__ = ("_heap", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, tuple[int, ...], int, Event]] = []
        self._seq = 0

    def push(self, t: float, event: Event, tie: tuple[int, ...] = ()) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, event.RANK, tie, self._seq, event))

    def first(self, live: bool) -> tuple[float, int]:
        """(time, rank) of the next event (``inf`` if none); gated ones dropped unless
        ``live``."""
        heap = self._heap
        if not live:
            while heap and heap[0][4].GATED:
                heapq.heappop(heap)
        if not heap:
            return math.inf, 0
        return heap[0][0], heap[0][1]

    def pop(self) -> Event:
        return heapq.heappop(self._heap)[4]
