"""``session-affinity``: ``least-load``, and a session's turns stick to the replica of its last
turn.

Both routers that weigh where a request is cheapest, this one and ``cache-aware`` (which builds
on it), are ``least-load`` (its load score and saturation rules, reused) with an affinity on
top, and both keep the same **load release**: a replica is preferred for affinity only while its
load score is within ``release_factor`` x the mean over the candidates with room, plus
``release_slack`` (a share of a window, so an idle fleet still has affinity). Past that it is
one replica among the others: affinity alone makes hot spots (one shared system prompt would
pile every tenant onto the replica that first ran it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from qosgate.core.routing.base import RouterContext
from qosgate.core.routing.least_load import LeastLoadRouter
from qosgate.core.routing.sessions import Binding, Sessions

if TYPE_CHECKING:
    from qosgate.core.replica import Replica
    from qosgate.core.request import Request

Row = tuple["Replica", bool, float]  # a candidate with room: (replica, saturated, load score)


class SessionAffinityRouter(LeastLoadRouter):
    """``least-load``, and a session's turns stick to the replica of its last turn while that
    replica is a candidate with room, not saturated and within the load release; otherwise
    least-load picks and the session re-binds where its turn went (failover)."""

    name = "session-affinity"

    def __init__(self, ctx: RouterContext) -> None:
        super().__init__()
        cache = ctx.cache
        self.release_factor = cache.release_factor
        self.release_slack = cache.release_slack
        self.sessions = Sessions(cache.session_idle_s)

    def pick(self, req: Request, candidates: Sequence[Replica], now: float) -> Replica | None:
        binding = self._binding(req, now)
        if binding is None:
            return super().pick(req, candidates, now)
        rows = self.rows(req, candidates, now)
        bound = self.release_bound(rows)
        for rep, saturated, score in rows:
            if rep.name == binding.replica and not saturated and score <= bound:
                return rep
        return super().pick(req, candidates, now)

    def _binding(self, req: Request, now: float) -> Binding | None:
        session = req.session
        return None if session is None else self.sessions.get(session, now)

    def rows(self, req: Request, candidates: Sequence[Replica], now: float) -> list[Row]:
        """The candidates with room, with their least-load (saturated, score)."""
        rows: list[Row] = []
        for rep in candidates:
            key = self.load(req, rep, now)
            if key is not None:
                rows.append((rep, key[0], key[1]))
        return rows

    def release_bound(self, rows: Sequence[Row]) -> float:
        """The load score past which a replica is passed over for affinity: the factor times
        the mean over the unsaturated candidates (all of them, if every one is), plus the
        slack."""
        scores = [score for _, saturated, score in rows if not saturated] or [
            score for _, _, score in rows]
        if not scores:
            return math.inf
        return self.release_factor * sum(scores) / len(scores) + self.release_slack

    def placed(self, req: Request, rep: Replica, now: float) -> int:
        if req.session is not None:
            self.sessions.bind(req.session, rep.name, req.prompt_tokens, now)
        return 0

    def cache_lost(self, name: str, now: float) -> None:
        self.sessions.drop_replica(name)
