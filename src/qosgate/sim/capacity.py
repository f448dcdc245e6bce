"""An engine's saturated throughput: the capacity a scenario's offered load is relative to."""

from __future__ import annotations

import math
from collections.abc import Sequence

from qosgate.models.simmodel import EngineProfile, SimEngine
from qosgate.models.step import FinishEvent, SeqSpec

INF = math.inf


def saturation_throughput(
    profile: EngineProfile,
    window: int,
    lengths: Sequence[tuple[int, int]],
    max_tokens: int,
) -> float:
    """Requests per second one engine completes when ``window`` requests are always in flight
    (a closed loop: each finish is replaced at once), for the given (prompt, output) mix.

    This is the capacity that "load" is relative to: offered load 1.0 means arrivals at the rate
    of this saturated throughput. Measured after the first quarter of the completions (warm-up)."""
    if not lengths:
        raise ValueError("no lengths to measure capacity with")
    eng = SimEngine(profile, "fcfs")
    it = 0
    now = 0.0

    def add() -> None:
        nonlocal it
        p, o = lengths[it % len(lengths)]
        p = min(p, profile.kv_capacity_tokens // 2)
        o = max(1, min(o, profile.kv_capacity_tokens - p))
        eng.add(SeqSpec(f"c{it}", p, max(o, max_tokens), target_output_tokens=o))
        it += 1

    for _ in range(min(window, len(lengths))):
        add()
    finishes: list[float] = []
    total = max(len(lengths), 4)
    while len(finishes) < total and eng.has_work():
        adv = eng.advance(INF, now)
        now = adv.now
        for t, e in adv.events:
            if isinstance(e, FinishEvent):
                finishes.append(t)
                add()
        if adv.steps == 0:
            break
    k0 = len(finishes) // 4
    if len(finishes) - k0 < 2 or finishes[-1] <= finishes[k0]:
        raise ValueError("capacity measurement did not reach a steady state")
    return (len(finishes) - 1 - k0) / (finishes[-1] - finishes[k0])
