"""Where the TPOT guard holds: the fraction of the strict classes' TPOT budget past which an
engine's mean inter-token latency holds the other classes off a replica (``Fleet._watch_itl``
applies it). One small class per way of choosing it, as ``core.windows`` has one per window
algorithm; each replica has its own, since engines of one fleet differ.

Why a learned one: the guard reads the engine's *mean* time per token, while the SLO is judged
per request. How far the slowest realtime streams sit above that mean depends on the traffic, so
a fixed fraction either over-protects at moderate load (the other classes pay for TPOT headroom
realtime does not need) or under-protects at heavy load (docs/experiments/tpot-guard.md). The
learned guard closes that loop on what the SLO judges: the TPOT the strict streams that ended
here actually got.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol


class TpotGuard(Protocol):
    @property
    def fraction(self) -> float:
        """The hold point, as a fraction of the tightest strict TPOT budget."""
        ...

    def on_stream_ended(self, tpot_over_budget: float) -> None:
        """A strict stream served here ended: its mean time per token over its class's budget."""
        ...


class FixedGuard:
    """A fraction set by the operator (``fleet.tpot_guard: 0.6``)."""

    __slots__ = ("fraction",)

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def on_stream_ended(self, tpot_over_budget: float) -> None:
        pass


class LearnedGuard:
    """A fraction steered by the strict streams' own TPOT (``fleet.tpot_guard: auto``).

    It judges the strict streams that ended here in batches of ``batch``: if their ``quantile``
    is past ``high`` of the budget, the guard tightens (times ``tighten``, down to ``lowest``);
    if under ``low``, it loosens (plus ``loosen``, up to ``highest``); in between it stays. It
    starts at ``highest``, past the budget itself: until realtime's streams miss, it holds only
    an engine whose mean time per token already fails realtime, and moderate load runs exactly
    as without it. The defaults were picked from a dozen variants tried in the simulator;
    docs/experiments/tpot-guard.md has what they give, and where they lose."""

    __slots__ = ("_batch", "batch", "fraction", "high", "highest", "loosen", "low", "lowest",
                 "quantile", "tighten")

    def __init__(
        self,
        *,
        lowest: float = 0.5,
        highest: float = 1.5,
        high: float = 0.95,
        low: float = 0.75,
        quantile: float = 0.95,
        batch: int = 16,
        tighten: float = 0.75,
        loosen: float = 0.05,
    ) -> None:
        if not (0 < lowest <= highest and 0 < low < high and 0 < tighten < 1 and loosen > 0
                and 0 < quantile <= 1 and batch >= 1):
            raise ValueError("LearnedGuard: need 0 < lowest <= highest, 0 < low < high, "
                             "0 < tighten < 1, loosen > 0, 0 < quantile <= 1, batch >= 1")
        self.fraction = highest
        self.lowest, self.highest = lowest, highest
        self.high, self.low, self.quantile = high, low, quantile
        self.tighten, self.loosen, self.batch = tighten, loosen, batch
        self._batch: list[float] = []

    def on_stream_ended(self, tpot_over_budget: float) -> None:
        batch = self._batch
        batch.append(tpot_over_budget)
        if len(batch) < self.batch:
            return
        # a fresh batch each time: streams that ran under the old hold point must not judge
        # the new one (with a sliding window one slow spell tightened it several times over)
        batch.sort()
        q = batch[min(len(batch) - 1, int(self.quantile * len(batch)))]
        batch.clear()
        if q > self.high:
            self.fraction = max(self.lowest, self.fraction * self.tighten)
        elif q < self.low:
            self.fraction = min(self.highest, self.fraction + self.loosen)


# each guard that ``fleet.tpot_guard`` names by a word; a number is a ``FixedGuard`` at it
GUARDS: dict[str, Callable[[], TpotGuard]] = {"auto": LearnedGuard}


def build_guard(mode: float | Literal["auto"]) -> TpotGuard:
    """The guard ``fleet.tpot_guard`` names: ``auto`` learns, a number is fixed."""
    return GUARDS[mode]() if isinstance(mode, str) else FixedGuard(mode)
