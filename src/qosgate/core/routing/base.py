"""The ``Router`` seam: one protocol whose hooks do nothing by default, and what a router is
built from.

A router only has to ``pick``; one that keeps state of its own (the cache-aware ones) overrides
the hooks ``Fleet`` calls as it keeps each replica's books. Each router subclasses ``Router``
to inherit the hooks it does not need, so a hook added here reaches every router at once.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

from qosgate.config import CacheRouting

if TYPE_CHECKING:
    from qosgate.core.replica import Replica
    from qosgate.core.request import Request


class Router(Protocol):
    name: str
    # whether it reads ``Request.prefix``: the gateway hashes a prompt's blocks only for one
    reads_prefix: bool = False

    def pick(self, req: Request, candidates: Sequence[Replica], now: float) -> Replica | None:
        """One of ``candidates`` (each eligible, serving the request's model, with room) or None
        to leave the request queued."""
        ...

    # what a router that keeps state of its own is told (nothing, by default). ``Fleet`` calls
    # these as it keeps each replica's books.
    def placed(self, req: Request, rep: Replica, now: float) -> int:
        """``req`` was sent to ``rep`` (not a paused request resuming there): the prompt tokens
        it expects ``rep``'s prefix cache to hold (what fairness does not charge)."""
        return 0

    def started(self, req: Request, rep: Replica) -> None:
        """``req``'s first byte came from ``rep``: its prefill is done."""
        return None

    def left(self, req: Request, rep: Replica) -> None:
        """``req`` left ``rep`` (ended, pulled back, failed)."""
        return None

    def follow_events(self, name: str) -> None:
        """Replica ``name``'s engine publishes its KV events: its index follows them only."""
        return None

    def cache_lost(self, name: str, now: float) -> None:
        """Replica ``name``'s cache is gone: it went down, died or restarted."""
        return None

    def observe_cache(self, name: str, now: float, stored: Sequence[int],
                      removed: Sequence[int], cleared: bool) -> None:
        """Replica ``name``'s engine stored or evicted blocks (keys as ``wire.prefix.chain``)."""
        return None

    def holds(self, req: Request, now: float) -> bool:
        """``req`` is left queued by choice: it waits, within its bound, for a warm replica
        or for KV room on one."""
        return False

    def wake_at(self, now: float) -> float:
        """When a request this router holds must be placed anyway (inf: none held)."""
        return math.inf


def cold_load(req: Request, rep: Replica) -> float:
    """What ``req`` costs ``rep`` to load its adapter, in reference tokens: its ``load_cost``
    where ``rep`` does not hold it loaded, twice that where the load evicts another adapter (the
    one evicted is loaded again by its next request: priced as this one, the only load cost the
    router knows), else nothing. Every router that weighs load adds it as that many prompt
    tokens more for ``rep`` to answer, so a request for an adapter goes to a replica holding it
    while that one is not busier by more than the load (the affinity is the load it saves, never
    a hard pin: a hot adapter still spreads), and a new adapter to a replica with a free slot."""
    cost = req.load_cost
    if not cost:
        return 0.0
    held = rep.adapters
    if held.holds(req.model):
        return 0.0
    return 2 * cost if held.full() else cost


class RouterContext(NamedTuple):
    """What a router is built from: the strict classes' TPOT and TTFT budgets (class level ->
    seconds), the class levels that may wait for a warm replica, and ``fleet.cache``."""

    strict_tpot_s: Mapping[int, float] = {}
    strict_ttft_s: Mapping[int, float] = {}
    may_wait_levels: frozenset[int] = frozenset()
    cache: CacheRouting = CacheRouting()
