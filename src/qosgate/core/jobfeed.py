"""How batch jobs are fed to the scheduler: which jobs get lines now and how many (``plan``), and
what happens to a line that did not succeed (``after_failure``).

Shared by the gateway's feeder (runtime/batches/feeder.py) and the simulator, so the policy the
simulator predicts with is the one that runs. The feeder only decides how many of a job's lines
are *offered*: the scheduler's class bands and shares decide who runs, so realtime and api traffic
keep precedence while an idle fleet still runs the job at full speed.

Bounded: a tenant's jobs keep at most ``queued_per_job`` lines waiting beyond what the fleet can
run at once (``capacity``), never the whole file. Earliest deadline first among a tenant's jobs;
each tenant has its own bound, so the scheduler's fair share between tenants sees every tenant's
job. Pure: the clock and the randomness are passed in.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "FeedJob",
    "Next",
    "RetryRule",
    "Verdict",
    "after_failure",
    "plan",
]


@dataclass(frozen=True, slots=True)
class FeedJob:
    """One live job as the feed policy sees it."""

    id: str
    tenant: str
    deadline: float  # the window's end (the same clock as ``now`` in ``after_failure``)
    in_flight: int  # lines handed to the scheduler and not ended (waiting or running)
    ready: int  # lines that could start now (no answer, not running, not backing off)


def plan(jobs: list[FeedJob], queued_per_job: int, capacity: int) -> list[tuple[str, int]]:
    """``(job id, lines to start now)`` for the jobs that get any, earliest deadline first.

    A tenant's jobs together keep at most ``queued_per_job + capacity`` lines in flight: enough
    to fill every free slot of the fleet and keep a short queue behind them, so that a job
    saturates an idle fleet, yet a 50,000-line file never becomes 50,000 queued requests."""
    bound = queued_per_job + max(capacity, 0)
    used: dict[str, int] = {}
    for j in jobs:
        used[j.tenant] = used.get(j.tenant, 0) + j.in_flight
    out: list[tuple[str, int]] = []
    for j in sorted(jobs, key=lambda j: (j.deadline, j.id)):
        room = bound - used[j.tenant]
        n = min(room, j.ready)
        if n > 0:
            used[j.tenant] += n
            out.append((j.id, n))
    return out


@dataclass(frozen=True, slots=True)
class RetryRule:
    """``settings.batches``' retry knobs: engine failures are tried again ``retries`` times,
    after ``backoff_s`` doubling up to ``backoff_max_s`` (jittered)."""

    retries: int
    backoff_s: float
    backoff_max_s: float


class Next(Enum):
    FINAL = "final"  # the line's answer is this response (or its error): record it
    RETRY = "retry"  # an engine failure: run it again at ``at``, one attempt spent
    WAIT = "wait"  # a refusal that asked to wait: run it again at ``at``, no attempt spent


@dataclass(frozen=True, slots=True)
class Verdict:
    next: Next
    at: float = 0.0


# refusals that mean "not now" rather than "never": the tenant's limits, a full queue, an
# overloaded or draining gateway
_WAIT_STATUSES = frozenset({429, 503})


def after_failure(
    status: int | None,
    retry_after_s: float | None,
    attempts: int,
    now: float,
    rule: RetryRule,
    rng: random.Random,
) -> Verdict:
    """What to do with a line that did not succeed.

    ``status`` is its response's HTTP status (None: no response at all, e.g. the engine was
    unreachable or timed out); ``attempts`` the engine failures it had *before* this one.

    - a client error (4xx but 429) is final at once: the request itself is wrong, and its
      response goes to the error file;
    - a refusal that asks to wait (429, or 503 with ``Retry-After``) waits that long (429
      without one: ``backoff_s``) and spends no attempt; the job's deadline ends such waiting;
    - an engine failure (5xx, 503 without ``Retry-After``, no response) spends an attempt and
      backs off ``backoff_s * 2**attempts`` (at most ``backoff_max_s``), jittered to between
      half and all of it so that lines failed together do not return together; after
      ``retries`` of them the line is final with its last response.
    """
    if status is not None and status in _WAIT_STATUSES and (
            retry_after_s is not None or status == 429):
        wait = retry_after_s if retry_after_s is not None else rule.backoff_s
        return Verdict(Next.WAIT, now + max(wait, 0.0))
    if status is not None and status < 500:
        return Verdict(Next.FINAL)
    if attempts >= rule.retries:
        return Verdict(Next.FINAL)
    delay = min(rule.backoff_max_s, rule.backoff_s * 2.0 ** attempts)
    return Verdict(Next.RETRY, now + delay * (0.5 + 0.5 * rng.random()))
