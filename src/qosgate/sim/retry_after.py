"""Whether a refusal's Retry-After was honest (``--retries``): the retries it sent back, how many
were let in, how long the refusals asked clients to wait, and whether the retries arrived spread
out or all in one second.

A Retry-After is honest when the client that waits it out gets in: a gateway that hands every
refused client the same short wait sends them all back together, a storm that is refused again.
So this reports, per class and for all classes, the retries sent and admitted, the Retry-After of
the refusals that were retried, and the spread of the retries over virtual time: the most that
landed in any one second against the mean per second over the seconds that had any (1 when they
came evenly; much more when they came in a storm).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from typing import Any

from qosgate.sim.metrics import percentile
from qosgate.sim.results import RequestRecord, RunResult

# what the figures mean (in the JSON's ``definitions``, with retries only)
RETRY_AFTER_DEFINITIONS = {
    "retries_sent": "attempts that retried a refused request after its Retry-After",
    "retries_admitted": "retries that were not refused again",
    "retry_success_rate": "retries admitted / retries sent",
    "retry_after_p50_s": "the Retry-After (seconds) of the refusals that were retried, its median "
    "(p90 and max likewise)",
    "retries_busiest_second": "the most retries that arrived in any one virtual second",
    "retries_per_second_mean": "retries sent / the virtual seconds in which any arrived (the "
    "busiest second far above it: a storm of retries)",
}


def _figures(retries: list[RequestRecord], waits: list[float]) -> dict[str, Any]:
    sent = len(retries)
    admitted = sum(1 for r in retries if r.state != "rejected")
    per_second = Counter(math.floor(r.arrival) for r in retries)
    waits.sort()
    return {
        "retries_sent": sent,
        "retries_admitted": admitted,
        "retry_success_rate": admitted / sent if sent else None,
        "retry_after_p50_s": percentile(waits, 50),
        "retry_after_p90_s": percentile(waits, 90),
        "retry_after_max_s": waits[-1] if waits else None,
        "retries_busiest_second": max(per_second.values(), default=0),
        "retries_per_second_mean": sent / len(per_second) if per_second else None,
    }


def retried_waits(records: Iterable[RequestRecord]) -> list[tuple[str, float]]:
    """(class, Retry-After) of each refused attempt that a later attempt retried (the last
    refusal of a client that gave up was not retried)."""
    recs = list(records)
    retried = {(r.retry_of, r.attempt - 1) for r in recs if r.attempt > 0}
    return [(r.service_class, r.retry_after) for r in recs
            if r.state == "rejected" and r.retry_after is not None
            and (r.retry_of or r.rid, r.attempt) in retried]


def retry_after_stats(result: RunResult) -> dict[str, Any]:
    """Per class (``classes``) and over all of them (``totals``), the figures of
    ``RETRY_AFTER_DEFINITIONS``."""
    retries = [r for r in result.records if r.attempt > 0]
    waits = retried_waits(result.records)
    classes = {
        cls: _figures([r for r in retries if r.service_class == cls],
                      [w for c, w in waits if c == cls])
        for cls in result.classes
    }
    return {"classes": classes, "totals": _figures(retries, [w for _, w in waits])}
