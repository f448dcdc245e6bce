"""The queue's timers: when each queued request times out or ages up a level.

One timer per queued request, for whichever comes first: its next promotion or its queue timeout
(re-armed when it fires), so a submit costs one heap push. A timer names the request and the
``gen`` it was armed at: a request that moved since (dispatched, ended, re-queued) changed its
``gen``, so its old timer is recognised as stale when it surfaces, without searching for it.

``Timers`` only answers: when a request expires or ages (``expiry``, ``ages_at``), which queued
request is due now (``pop_due``), and when the next one is (``next_at``). The scheduler times the
request out or promotes it, and re-arms it.
"""

from __future__ import annotations

import heapq
import math

from qosgate.config import ServiceClass
from qosgate.core.request import QUEUED, Request


class Timers:
    __slots__ = ("_aging_after", "_seq", "_timeout", "due", "heap")

    def __init__(self, classes: list[ServiceClass], aging: bool, ceiling: int) -> None:
        """``aging``: aging is on (and the policy has levels to age through); ``ceiling``: the
        level it stops at."""
        # per level (tables, not attribute chains, on every submit): the queue timeout, and
        # after how long a request waiting there ages (None: never; always None without aging
        # and at or above the ceiling)
        self._timeout = [c.queue_timeout_s for c in classes]
        self._aging_after = [
            c.aging_after_s if aging and c.level > ceiling else None for c in classes]
        self._seq = 0
        # (when, seq, request, its gen when armed)
        self.heap: list[tuple[float, int, Request, int]] = []
        # when the first timer in the heap is due (inf: none), live or stale: what the hot
        # handlers compare ``now`` with before asking for anything (one attribute, not a look
        # at the heap's first row)
        self.due = math.inf

    def expiry(self, req: Request, now: float) -> float:
        """When ``req``, queued at ``now``, times out."""
        return now + self._timeout[req.class_level]

    def ages_at(self, req: Request, now: float) -> float:
        """When ``req``, waiting at its level since ``now``, moves up a level (inf: never)."""
        after = self._aging_after[req.level]
        return math.inf if after is None else now + after

    def arm(self, req: Request, queued: int) -> None:
        """A timer for ``req``'s next promotion or timeout; ``queued``: requests queued now
        (past twice that many timers, the stale ones of dispatched requests are dropped)."""
        self._seq += 1
        heap = self.heap
        when = req.ages_at if req.ages_at < req.expires_at else req.expires_at
        heapq.heappush(heap, (when, self._seq, req, req.gen))
        if when < self.due:
            self.due = when
        if len(heap) > 2 * queued + 1024:
            heap[:] = [t for t in heap if t[2].gen == t[3] and t[2].state is QUEUED]
            heapq.heapify(heap)
            self.due = heap[0][0] if heap else math.inf

    def pop_due(self, now: float) -> Request | None:
        """The next queued request whose timer is due at ``now`` (its timer is gone: re-arm it
        if it stays queued), or None."""
        heap = self.heap
        while heap and heap[0][0] <= now:
            _, _, req, gen = heapq.heappop(heap)
            self.due = heap[0][0] if heap else math.inf
            if req.gen == gen and req.state is QUEUED:
                return req
        return None

    def next_at(self) -> float | None:
        """When the earliest live timer is due (stale ones on top are dropped), or None."""
        heap = self.heap
        while heap:
            when, _, req, gen = heap[0]
            if req.gen == gen and req.state is QUEUED:
                return when
            heapq.heappop(heap)
            self.due = heap[0][0] if heap else math.inf
        return None
