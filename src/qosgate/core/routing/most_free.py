"""``most-free``: the replica with the most free slots, the simplest rule (no measured load)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from qosgate.core.routing.base import Router

if TYPE_CHECKING:
    from qosgate.core.replica import Replica
    from qosgate.core.request import Request


class MostFreeRouter(Router):
    """The replica with the most free slots (first listed on ties)."""

    name = "most-free"

    def pick(self, req: Request, candidates: Sequence[Replica], now: float) -> Replica | None:
        best: Replica | None = None
        best_free = 0
        for rep in candidates:
            if not rep.fits(req.model):
                continue
            f = rep.window - rep.held
            if f > best_free:
                best, best_free = rep, f
        return best
