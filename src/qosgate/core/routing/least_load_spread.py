"""``least-load-spread``: ``least-load`` that spreads the strict classes' streams over the fleet
and keeps them off a replica whose engine is past their time-per-token budget."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from qosgate.core.routing.least_load import LeastLoadRouter

if TYPE_CHECKING:
    from qosgate.core.replica import Replica
    from qosgate.core.request import Request


class SpreadStrictRouter(LeastLoadRouter):
    """``least-load``, and for a request of a strict class two more terms: the strict streams
    the replica already runs (counted twice, so realtime spreads over the fleet), and a full
    window's worth on a replica whose engine's time per token is past the request's TPOT
    budget (it would miss there). Why: with the prefill budget, a replica streaming to realtime
    keeps the other classes' prompts off and so looks least loaded to the next realtime request;
    realtime piles onto one replica by itself, and that replica's death cuts all its streams
    (docs/experiments/simulator-fleet.md, ``fleet-faults``)."""

    name = "least-load-spread"

    def __init__(self, strict_tpot_s: Mapping[int, float] | None = None) -> None:
        super().__init__()
        self.strict_tpot_s = dict(strict_tpot_s or {})  # class level -> its TPOT budget

    def _extra(self, req: Request, rep: Replica, window: int) -> float:
        budget = self.strict_tpot_s.get(req.class_level)
        if budget is None:
            return 0.0
        slow = misses_tpot(rep, budget)
        return rep.strict_streams / max(1, window) + (1.0 if slow else 0.0)


def misses_tpot(rep: Replica, budget_s: float) -> bool:
    """``rep``'s engine's recent time per token is past ``budget_s``: a stream there misses it."""
    return rep.itl_s is not None and rep.itl_s > budget_s
