"""A batch job's figures in a simulated run, and the two estimates its simulated completion time
is read against.

- The prediction is the simulation itself: the time from the job's submission to its last
  line's answer, with the live workload running beside it through the same scheduler.
- ``idle_fleet_s``: the job alone on the fleet, at the fleet's saturated rate for the job's own
  line lengths (``capacity.saturation_throughput`` summed over the replicas): the floor.
- ``spare_capacity_s``: a fluid estimate from today's load: in each minute the job gets the
  idle rate times the fraction of the fleet the live arrivals leave (1 - live requests/s over the
  fleet's capacity for the live mix, at least 0). It ignores queueing and the class shares, so
  it is the back-of-envelope a user would do; the simulation is the answer.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

from qosgate.sim.results import BatchResult

FLUID_BIN_S = 60.0


def fluid_finish(
    lines: int,
    rate: float,
    start: float,
    live_arrivals: Sequence[float],
    live_capacity_rps: float | None,
    bin_s: float = FLUID_BIN_S,
) -> float | None:
    """Seconds from ``start`` until ``lines`` are done at ``rate`` x the spare fraction of each
    ``bin_s`` (``live_arrivals`` sorted); None without a live capacity or a rate."""
    if not live_capacity_rps or rate <= 0:
        return None
    done = 0.0
    t = start
    last = live_arrivals[-1] if live_arrivals else -math.inf
    while t <= last:
        n = (bisect.bisect_left(live_arrivals, t + bin_s)
             - bisect.bisect_left(live_arrivals, t))
        spare = max(0.0, 1.0 - n / bin_s / live_capacity_rps)
        step = rate * spare * bin_s
        if done + step >= lines:
            return t - start + (lines - done) / (rate * spare)
        done += step
        t += bin_s
    return t - start + (lines - done) / rate


def batch_stats(
    job: BatchResult, idle_rate: float | None, spare_s: float | None
) -> dict[str, Any]:
    """One job's row: lines by outcome, start and end, completion time against its window, its
    output tokens/s, and the estimates."""
    took = None if job.finished_at is None else job.finished_at - job.at
    busy = None
    if job.finished_at is not None and job.started_at is not None:
        busy = job.finished_at - job.started_at
    return {
        "class": job.qos_class,
        "tenant": job.tenant,
        "served_classes": job.served_classes,
        "lines": job.lines,
        "status": job.status,
        "done": job.done,
        "failed": job.failed,
        "expired": job.expired,
        "attempts": job.submitted,
        "retried": job.retried,
        "waited": job.waited,
        "answered_twice": job.answered_twice,
        "submitted_s": job.at,
        "started_s": job.started_at,
        "finished_s": job.finished_at,
        "window_s": job.completion_window_s,
        "completion_s": took,
        "within_window": (took is not None and took <= job.completion_window_s
                          and job.done == job.lines),
        "of_window": None if took is None else took / job.completion_window_s,
        "output_tokens": job.output_tokens,
        "output_tok_s": job.output_tokens / busy if busy else None,
        "lines_per_s": job.done / busy if busy else None,
        "idle_fleet_s": job.lines / idle_rate if idle_rate else None,
        "spare_capacity_s": spare_s,
    }


def batches_ok(jobs: Sequence[BatchResult], outcomes: dict[str, int], attempts: int) -> bool:
    """Every job ended, each of its lines once (done, failed or expired), none answered twice,
    and every attempt has exactly one outcome in the core's ledger."""
    return (
        all(j.status != "in_progress" and j.done + j.failed + j.expired == j.lines
            and not j.answered_twice for j in jobs)
        and sum(outcomes.values()) == attempts
    )
