"""Queue nodes that compose into every policy: a keyed heap, a strict band, a fair-share split.

Why nodes: vLLM keeps small policy classes behind one interface, which is right, but each one
re-implements ordering and its cancel is O(n). Here each idea exists once and policies are trees of
them (``qos`` = strict realtime band over a weighted split of classes, each split by tenant, each
tenant ordered by deadline). Removal is lazy: ``remove`` fixes the live counts along the request's
path in O(depth) and the heap row is skipped when it surfaces; heaps are compacted when stale rows
outnumber live ones, so insert/pop/cancel are O(log n) amortised and memory stays O(n).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Hashable, Sequence
from heapq import heapify, heappop, heappush
from typing import Protocol

from qosgate.core.queueing.fairshare import FairShare
from qosgate.core.request import Request


class Node(Protocol):
    n: int

    def push(self, req: Request) -> None: ...

    def pop(self) -> Request | None: ...

    def remove(self, req: Request) -> None: ...

    def settle(self, req: Request, delta_cost: float) -> None:
        """Correct the charge of ``req`` by ``delta_cost`` (0: nothing to do)."""
        ...

    def reweigh(self) -> None:
        """Read the weights again (a reload changed the tenants'), for the keys it has."""
        ...

    def restore(self, req: Request) -> None:
        """Undo ``pop`` for a request that was popped and not served (held): back in place,
        its charge refunded, and no VTC lift for a key that emptied only by that pop."""
        ...


class KeyedQueue:
    """A min-heap of requests by ``key(req)``, ties in push order. ``req.seq`` identifies the live
    row: a row whose seq differs from its request's is stale (removed, or pushed again)."""

    __slots__ = ("_heap", "_key", "_seq", "n")

    def __init__(self, key: Callable[[Request], float], seq: list[int]) -> None:
        self.n = 0
        self._heap: list[tuple[float, int, Request]] = []
        self._key = key
        self._seq = seq  # one counter shared by the whole tree, so seqs are unique

    def push(self, req: Request) -> None:
        s = self._seq[0] = self._seq[0] + 1
        req.seq = s
        heap = self._heap
        heappush(heap, (self._key(req), s, req))
        self.n += 1

    def pop(self) -> Request | None:
        heap = self._heap
        while heap:
            _, s, req = heappop(heap)
            if s == req.seq:
                self.n -= 1
                req.seq = -s  # popped: no row is live, but restore keeps its place in ties
                return req
        return None

    def remove(self, req: Request) -> None:
        self.n -= 1
        req.seq = 0  # its row is stale: the only way one is left behind (pop takes its own)
        heap = self._heap
        if len(heap) > 2 * self.n + 64:
            live = [row for row in heap if row[1] == row[2].seq]
            heapify(live)
            self._heap = live

    def settle(self, req: Request, delta_cost: float) -> None:
        pass

    def reweigh(self) -> None:
        return None  # no weights

    def restore(self, req: Request) -> None:
        if req.seq >= 0:
            self.push(req)
            return
        req.seq = s = -req.seq
        heappush(self._heap, (self._key(req), s, req))
        self.n += 1


class StrictBands:
    """Children by band; the first non-empty band is always served first. ``band_of_level[l]``
    is the band of a request waiting at level ``l`` (a table, not a call, on every push)."""

    __slots__ = ("_bands", "_by_level", "n")

    def __init__(self, bands: list[Node], band_of_level: Sequence[int]) -> None:
        self.n = 0
        self._bands = bands
        self._by_level = [bands[b] for b in band_of_level]  # level -> its band's node

    def push(self, req: Request) -> None:
        self._by_level[req.level].push(req)
        self.n += 1

    def pop(self) -> Request | None:
        if self.n:
            for band in self._bands:
                if band.n:
                    self.n -= 1
                    return band.pop()
        return None

    def remove(self, req: Request) -> None:
        self._by_level[req.level].remove(req)
        self.n -= 1

    def settle(self, req: Request, delta_cost: float) -> None:
        if delta_cost:
            self._by_level[req.level].settle(req, delta_cost)

    def reweigh(self) -> None:
        for band in self._bands:
            band.reweigh()

    def restore(self, req: Request) -> None:
        self._by_level[req.level].restore(req)
        self.n += 1


class FairSplit(FairShare[Hashable]):
    """Children by key (class or tenant), served by weighted virtual counters: it is the
    ``FairShare`` of its keys (so a pop reads and moves the counters' rows itself, one Python
    call per level of the tree; ``share`` names the counters for those that read them).

    The estimated cost ``req.cost`` is charged when a request is popped; ``settle`` corrects it
    with the real usage (or refunds it when a request is pulled back before its first token).
    ``charge_of`` names the counter that pays when it differs from the child the request waits in:
    an aged request waits in a more urgent class but is paid for by its own, so aging reorders
    who goes first without shifting the shares between classes. ``rank`` breaks ties between
    equal counters (a class's level: a class returning from idle is lifted to the others'
    counter, and on that tie the more urgent class goes first).

    With ``tags`` (the split whose order is a request's rank in its engine band: tenants inside a
    class), a popped request carries the counter it was picked at (``req.tag``), and that tag is
    *held* in the counters until the request starts (``release``), so a key returning from idle
    is not lifted past work the engines have not started (see ``fairshare``).
    """

    __slots__ = ("_charge_of", "_children", "_key_of", "_make", "_nested", "_tags", "_weight_of",
                 "n")

    def __init__(
        self,
        key_of: Callable[[Request], Hashable],
        weight_of: Callable[[Hashable], float],
        make_child: Callable[[], Node],
        charge_of: Callable[[Request], Hashable] | None = None,
        rank: Callable[[Hashable], int] | None = None,
        tags: bool = False,
    ) -> None:
        super().__init__(rank)
        self.n = 0
        self._tags = tags
        self._children: dict[Hashable, Node] = {}
        # whether the children are splits themselves, with counters to settle (a leaf queue's
        # ``settle`` does nothing: not called on every completion)
        self._nested = True
        self._key_of = key_of
        self._charge_of = charge_of or key_of
        self._weight_of = weight_of
        self._make = make_child

    @property
    def share(self) -> FairShare[Hashable]:
        """The counters of its keys (itself): what the shared state merges across instances."""
        return self

    def push(self, req: Request) -> None:
        key = self._key_of(req)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = self._make()
            self._nested = not isinstance(child, KeyedQueue)
            self.set_weight(key, self._weight_of(key))
        child.push(req)
        if child.n == 1:
            self.activate(key)
        self.n += 1

    def pop(self) -> Request | None:
        rows = self._rows
        if not rows:
            return None
        key = rows[0][2]  # (``pick``, inline)
        child = self._children[key]
        req = child.pop()
        assert req is not None, "a backlogged key always has a live request"
        self.n -= 1
        counter = self.counter
        tag = counter[key]
        if self._tags:
            self._held[req] = tag  # (held until it starts: ``release``)
            req.tag = tag
            req.tagged_by = self
        payer = self._charge_of(req)
        if child.n and payer == key:
            # the common case: the key's row is the first, and moves back at its new counter
            # (``charge``, inline)
            c = counter[key] = tag + req.cost / self._weight.get(key, 1.0)
            if c != tag:
                order = rows[0][1]
                del rows[0]
                insort(rows, (c, order, key))
        else:
            if not child.n:
                self.deactivate(key)
            self.charge(payer, req.cost)
        return req

    def remove(self, req: Request) -> None:
        key = self._key_of(req)
        child = self._children[key]
        child.remove(req)
        self.n -= 1
        if child.n == 0:
            self.deactivate(key)

    def settle(self, req: Request, delta_cost: float) -> None:
        if not delta_cost:
            return
        # (``charge``, inline: every completion settles once per level)
        key = self._charge_of(req)
        counter = self.counter
        old = counter.get(key, 0.0)
        c = counter[key] = old + delta_cost / self._weight.get(key, 1.0)
        if c != old and key in self._active:
            rows = self._rows
            order = self._order[key]
            del rows[bisect_left(rows, (old, order))]
            insort(rows, (c, order, key))
        if self._nested:
            child = self._children.get(self._key_of(req))
            if child is not None:
                child.settle(req, delta_cost)

    def reweigh(self) -> None:
        for key, child in self._children.items():
            self.set_weight(key, self._weight_of(key))
            child.reweigh()

    def restore(self, req: Request) -> None:
        # a key that a hold emptied did not go idle: lifting it would cost it the credit it
        # had (a class held on every fill would lose its share to the classes it waits beside)
        key = self._key_of(req)
        self.charge(self._charge_of(req), -req.cost)
        if self._tags:
            release(req)  # it was not dispatched: nothing of it waits in an engine
        child = self._children[key]
        child.restore(req)
        if child.n == 1:
            self.activate(key, lift=False)
        self.n += 1


def release(req: Request) -> None:
    """``req`` started in its engine, or left it unstarted: its tag no longer holds lifts back."""
    share = req.tagged_by
    if share is not None:
        share.release(req)
        req.tagged_by = None
