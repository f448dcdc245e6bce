"""``least-load``: the least loaded replica by measured load, the default, and the load score
and saturation rules the other routers build on."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from qosgate.core.routing.base import Router, cold_load

if TYPE_CHECKING:
    from qosgate.core.replica import Replica
    from qosgate.core.request import Request


class LeastLoadRouter(Router):
    """The least loaded replica by measured load: its share of the window in flight (with the
    request to place), prompt tokens it has not answered yet (local accounting, exact and
    immediate; with a LoRA adapter's load where it is cold, ``cold_load``) and what its last
    scrape said of its own queue and KV cache. Data older than
    ``stale_s`` counts as saturated; a saturated replica (its queue past ``waiting_saturated``
    per window slot, or its KV cache past ``kv_saturated``) is taken only if every candidate
    is. (Weighing replicas by their recent dispatch-to-first-byte time was tried and reverted:
    the average lags a growing queue and herded traffic onto one replica, docs/guides/fleet.md.)"""

    name = "least-load"

    def __init__(
        self,
        stale_s: float = 5.0,
        kv_saturated: float = 0.97,
        waiting_saturated: float = 0.25,
        tokens_per_slot: float = 2048.0,
    ) -> None:
        self.stale_s = stale_s
        self.kv_saturated = kv_saturated
        self.waiting_saturated = waiting_saturated
        self.tokens_per_slot = tokens_per_slot

    def pick(self, req: Request, candidates: Sequence[Replica], now: float) -> Replica | None:
        best: Replica | None = None
        best_key = (True, math.inf)
        for rep in candidates:
            key = self.load(req, rep, now)
            if key is not None and key < best_key:
                best, best_key = rep, key
        return best

    def load(self, req: Request, rep: Replica, now: float) -> tuple[bool, float] | None:
        """``rep``'s (saturated, load score) with ``req`` on it; None: its window is full."""
        window = rep.window
        if not rep.fits(req.model):
            return None
        # (the window in use in slots: a heavier model's request holds more, see
        # core.slot_costs; a cold adapter load weighs as that many prompt tokens)
        prefill = rep.prefill_tokens + cold_load(req, rep)
        score = (rep.held + rep.cost_of(req.model) + prefill / self.tokens_per_slot
                 ) / max(1, window)
        score += self._extra(req, rep, window)
        sig = rep.signals
        saturated = False  # no scrape at all (an engine without metrics): no evidence
        if sig is not None:
            if now - sig.at > self.stale_s:
                saturated = True
            else:
                if sig.waiting:
                    score += sig.waiting / max(1, window)
                    saturated = sig.waiting > self.waiting_saturated * window
                if sig.kv_usage is not None and sig.kv_usage >= self.kv_saturated:
                    saturated = True
        return (saturated, score)

    def _extra(self, req: Request, rep: Replica, window: int) -> float:
        """What a variant adds to a replica's load score for this request (nothing here)."""
        return 0.0
