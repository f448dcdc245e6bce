"""Slot costs: how much of a replica's window a request of each of its models holds.

A window bounds the work in flight on an engine. Where an engine serves several models (a
heavy model beside a light one, or a base with its adapters), a request of the heavy model
takes many times the engine's time per step that one of the light model does; counted as one
request each, a flood of heavy work fills the window, and the light model's realtime waits
behind engine time the window said was free. So such a window counts cost: a request holds its
model's output weight (``core.weights``: decode dominates an engine's time per request)
relative to the lightest model the replica serves, rounded to whole slots (at least one), so
that the lightest model's requests hold one slot each, exactly as before, and every rule that
counts slots (the reserved share for the strict classes included) counts in that unit.

A replica serving one model, or any model, or only models of equal weight keeps one slot per
request: its window is the one the engine's own signals size (``core.windows``), which already
holds a heavy model's smaller batch. Where a window counts slots, the engine's own counts of
sequences running and waiting are read in slots too (``in_slots``), so that the adaptive window
sizes itself in the unit it counts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from qosgate.core.signals import LoadSignals
from qosgate.core.weights import ModelWeights


def slot_costs(models: Iterable[str], weights: ModelWeights) -> dict[str, int]:
    """Each of ``models``' slot cost on a replica serving them, for those above one slot
    (empty: every request holds one slot)."""
    served = sorted(set(models))
    if len(served) < 2 or not weights.weighted:
        return {}
    output = {m: weights.of(m).output for m in served}
    lightest = min(output.values())
    if lightest <= 0:
        return {}
    costs = {m: max(1, round(w / lightest)) for m, w in output.items()}
    return {m: c for m, c in costs.items() if c > 1}


def in_slots(signals: LoadSignals, held: int, inflight: int) -> LoadSignals:
    """``signals`` with the engine's sequences running and waiting counted in slots, at the
    mean slot cost of the ``inflight`` requests that hold ``held`` slots (the engine does not
    say which model each sequence is of: the gateway's own mix stands in for it)."""
    if not inflight or held == inflight:
        return signals
    scale = held / inflight
    running, waiting = signals.running, signals.waiting
    return replace(signals,
                   running=None if running is None else round(running * scale),
                   waiting=None if waiting is None else round(waiting * scale))
