"""How batch jobs are fed to the scheduler: which jobs get lines now and how many (``plan``), and
what happens to a line that did not succeed (``after_failure``).

Shared by the gateway's feeder (runtime/batches/feeder.py) and the simulator, so the policy the
simulator predicts with is the one that runs. The feeder decides how many of a job's lines are
offered, on the slots live traffic leaves free (``SpareCapacity``): realtime and api keep their
slots while an idle fleet still runs the job at full speed. Who runs among what is offered is
the scheduler's (class bands, shares, tenants' fairness), as for any request.

Bounded: the jobs keep at most the slots live traffic leaves free (``SpareCapacity``) plus
``queued_per_job`` lines in flight, never the whole file. Earliest deadline first among a
tenant's jobs; the tenants with jobs split the spare slots, and the scheduler's fair share
between tenants sees every tenant's job. Pure: the clock and the randomness are passed in.
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass
from enum import Enum

__all__ = [
    "SWEEP_S",
    "FeedBatch",
    "Next",
    "RetryRule",
    "SpareCapacity",
    "Verdict",
    "after_failure",
    "plan",
]


# how often a feeder looks again on its own (besides line ends and new jobs): the spare slots
# live traffic leaves change without any job event
SWEEP_S = 1.0


@dataclass(frozen=True, slots=True)
class FeedBatch:
    """One live job as the feed policy sees it."""

    id: str
    tenant: str
    deadline: float  # the window's end (the same clock as ``now`` in ``after_failure``)
    in_flight: int  # lines handed to the scheduler and not ended (waiting or running)
    ready: int  # lines that could start now (no answer, not running, not backing off)


def plan(jobs: list[FeedBatch], queued_per_job: int, spare: int) -> list[tuple[str, int]]:
    """``(job id, lines to start now)`` for the jobs that get any, earliest deadline first.

    ``spare`` is what live traffic leaves of the fleet (``SpareCapacity``). The tenants with jobs
    split it evenly, and each tenant's jobs together keep at most their part plus
    ``queued_per_job`` lines in flight: enough to fill the slots live traffic leaves free, never
    so many that a job's lines wait in the scheduler's queue beside live requests (where the
    weighted shares would give some freed slots to them while api waits), and a 50,000-line file
    never becomes 50,000 queued requests."""
    used: dict[str, int] = {}
    for j in jobs:
        used[j.tenant] = used.get(j.tenant, 0) + j.in_flight
    share = -(-max(spare, 0) // len(used)) if used else 0
    bound = share + queued_per_job
    out: list[tuple[str, int]] = []
    for j in sorted(jobs, key=lambda j: (j.deadline, j.id)):
        room = bound - used[j.tenant]
        n = min(room, j.ready)
        if n > 0:
            used[j.tenant] += n
            out.append((j.id, n))
    return out


class SpareCapacity:
    """The slots live traffic leaves free: the fleet's capacity less the most live requests
    (queued or running, job lines not counted) seen over the last ``lookback_s``, less a headroom
    while there is live traffic at all.

    Why the recent peak and not the present count: a job line holds its slot for a whole answer,
    so a slot given to a job now is not there for the live burst that comes a second later; live
    requests would wait for job lines to finish (api may not pre-empt them), which is exactly
    what a job must not do to interactive traffic. With no live traffic in the lookback the job
    gets the whole fleet. Until a whole lookback has been watched (a gateway that has just
    started, a simulated job at the start of its trace) nobody knows what live traffic is
    like: the spare slots grow from none to all over that first lookback instead of a job taking
    the whole fleet at once, the moment before a burst. Pure: time is passed in."""

    def __init__(self, lookback_s: float, headroom: float) -> None:
        self.lookback_s = lookback_s
        self.headroom = headroom  # share of the capacity kept free while live traffic runs
        self._peaks: deque[tuple[float, int]] = deque()  # (time, live), live decreasing
        self._since: float | None = None  # the first look

    def observe(self, now: float, live: int) -> None:
        if self._since is None:
            self._since = now
        peaks = self._peaks
        while peaks and peaks[-1][1] <= live:
            peaks.pop()
        peaks.append((now, live))

    def peak(self, now: float) -> int:
        peaks = self._peaks
        while len(peaks) > 1 and peaks[0][0] < now - self.lookback_s:
            peaks.popleft()
        # (the last sample stays however old it is: it is the present count)
        return peaks[0][1] if peaks else 0

    def spare(self, now: float, capacity: int) -> int:
        capacity = max(capacity, 0)
        peak = self.peak(now)
        free = capacity if peak <= 0 else max(
            capacity - peak - max(1, math.ceil(self.headroom * capacity)), 0)
        watched = now - self._since if self._since is not None else 0.0
        if watched < self.lookback_s:
            free = min(free, int(capacity * watched / self.lookback_s))
        return free


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
