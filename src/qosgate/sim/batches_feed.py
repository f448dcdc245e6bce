"""The simulator's feeder: what the gateway's feeder (runtime/batches/feeder.py) does with a job's
lines, in virtual time, with the same pure policy (``core.batches_feed``): which jobs get lines now
and how many (``plan``), and what becomes of a line that did not succeed (``after_failure``).

The driver asks ``take`` for the lines to submit (each attempt is a new request to the one
scheduler, at the job's class and tenant, as the gateway's feeder sends it through the request
flow), tells ``ended`` how each attempt ended, and ``expire`` when a job's window closes. The
core's outcomes map to what the feed policy reads as the gateway's HTTP answer would carry it:
a refusal with a Retry-After waits (no attempt spent), a refusal without one is the client's
error (final), a queue timeout or an engine failure is a failed attempt (retried with back-off).
"""

from __future__ import annotations

import random
from collections import Counter, deque
from dataclasses import dataclass, field

from qosgate.core.batches_feed import FeedBatch, Next, RetryRule, SpareCapacity, after_failure, plan
from qosgate.settings import BatchSettings
from qosgate.sim.batches import BatchPlan
from qosgate.sim.results import BatchResult

# what the gateway would answer for a core outcome, as far as the feed policy tells them apart
_STATUS = {"timed_out": 504, "failed": 502, "cancelled": 499}


@dataclass(slots=True)
class _Batch:
    plan: BatchPlan
    ready: deque[int] = field(default_factory=deque)  # lines that may start now, in file order
    in_flight: dict[str, int] = field(default_factory=dict)  # request id -> line
    waiting: set[int] = field(default_factory=set)  # lines backing off or waiting Retry-After
    failures: Counter[int] = field(default_factory=Counter)  # engine failures per line
    completions: Counter[int] = field(default_factory=Counter)  # answers recorded per line
    open: bool = False
    ended: bool = False
    expired: bool = False
    done: int = 0
    failed: int = 0
    expired_lines: int = 0
    submitted: int = 0
    retried: int = 0
    waited: int = 0
    output_tokens: int = 0
    started_at: float | None = None
    finished_at: float | None = None
    served_class: Counter[str] = field(default_factory=Counter)


class SimBatches:
    """Every job of a run and the state of each line (ready, in flight, waiting, answered)."""

    def __init__(self, plans: tuple[BatchPlan, ...], settings: BatchSettings, rule: RetryRule,
                 seed: int) -> None:
        self.jobs = [_Batch(p) for p in plans]
        self.queued_per_job = settings.queued_per_job
        self.spare = SpareCapacity(settings.live_span_s, settings.headroom)
        self.rule = rule
        self.rng = random.Random(f"{seed}:job-retries")
        self.owner: dict[str, tuple[int, int]] = {}  # request id -> (job, line)
        self.outcomes: Counter[str] = Counter()  # every attempt's outcome (the core's ledger)

    @property
    def plans(self) -> tuple[BatchPlan, ...]:
        return tuple(j.plan for j in self.jobs)

    def live(self) -> bool:
        """A job not ended yet (before its submission too)."""
        return any(not j.ended for j in self.jobs)

    def waiting_for_room(self) -> bool:
        """A job has lines that could start but none of its own in flight: nothing of it will
        wake the feed (the gateway's feeder looks again every ``SWEEP_S``)."""
        return any(j.open and not j.ended and j.ready and not j.in_flight for j in self.jobs)

    def open(self, k: int, now: float) -> None:
        """Job ``k`` is submitted: every line is ready."""
        job = self.jobs[k]
        job.open = True
        job.started_at = now
        job.ready.extend(range(len(job.plan.lines)))
        self._maybe_end(job, now)

    def take(self, capacity: int, in_scheduler: int, now: float) -> list[tuple[int, int, str]]:
        """``(job, line, request id)`` to submit now, per ``core.batches_feed.plan``, on what live
        traffic leaves of ``capacity`` (``in_scheduler``: every request queued or running,
        job lines too)."""
        self.spare.observe(now, max(in_scheduler - len(self.owner), 0))
        live = [
            FeedBatch(str(k), j.plan.tenant or "", j.plan.deadline, len(j.in_flight), len(j.ready))
            for k, j in enumerate(self.jobs) if j.open and not j.ended
        ]
        out: list[tuple[int, int, str]] = []
        for jid, n in plan(live, self.queued_per_job, self.spare.spare(now, capacity)):
            k = int(jid)
            job = self.jobs[k]
            for _ in range(n):
                line = job.ready.popleft()
                job.submitted += 1
                rid = f"job{k}.{line}.{job.submitted}"
                job.in_flight[rid] = line
                self.owner[rid] = (k, line)
                out.append((k, line, rid))
        return out

    def ended(self, rid: str, state: str, served_class: str, retry_after: float | None,
              output_tokens: int, now: float) -> float | None:
        """Attempt ``rid`` ended in ``state``: the line is answered, final, or due again at the
        returned time (None: nothing to wake up for)."""
        k, line = self.owner.pop(rid)
        job = self.jobs[k]
        del job.in_flight[rid]
        self.outcomes[state] += 1
        if state == "completed":
            job.done += 1
            job.completions[line] += 1
            job.output_tokens += output_tokens
            job.served_class[served_class] += 1
            self._maybe_end(job, now)
            return None
        if job.expired:  # cancelled by the window's end: expired with the rest
            job.expired_lines += 1
            self._maybe_end(job, now)
            return None
        status = 503 if state == "rejected" and retry_after is not None else _STATUS.get(state, 400)
        verdict = after_failure(status, retry_after, job.failures[line], now, self.rule, self.rng)
        if verdict.next is Next.FINAL:
            job.failed += 1
            self._maybe_end(job, now)
            return None
        if verdict.next is Next.RETRY:
            job.failures[line] += 1
            job.retried += 1
        else:
            job.waited += 1
        job.waiting.add(line)
        return verdict.at if verdict.at < job.plan.deadline else None

    def due(self, k: int, line: int) -> None:
        """A waiting line's time has come: it is ready again (unless its job ended)."""
        job = self.jobs[k]
        if line in job.waiting and not job.ended:
            job.waiting.discard(line)
            job.ready.appendleft(line)

    def expire(self, k: int, now: float) -> list[str]:
        """Job ``k``'s window is over: lines not answered expire; returns the attempts in flight,
        which the driver cancels (each then ends here as expired)."""
        job = self.jobs[k]
        if job.ended:
            return []
        job.expired = True
        job.expired_lines += len(job.ready) + len(job.waiting)
        job.ready.clear()
        job.waiting.clear()
        self._maybe_end(job, now)
        return list(job.in_flight)

    def _maybe_end(self, job: _Batch, now: float) -> None:
        if job.ended or not job.open:
            return
        if job.ready or job.waiting or job.in_flight:
            return
        job.ended = True
        job.finished_at = now

    def records(self) -> list[BatchResult]:
        out = []
        for j in self.jobs:
            p = j.plan
            out.append(BatchResult(
                name=p.name, qos_class=p.qos_class, tenant=p.tenant or "", lines=len(p.lines),
                at=p.at, completion_window_s=p.completion_window_s, done=j.done, failed=j.failed,
                expired=j.expired_lines,
                submitted=j.submitted, retried=j.retried, waited=j.waited,
                output_tokens=j.output_tokens, started_at=j.started_at, finished_at=j.finished_at,
                status=_status(j), answered_twice=sum(1 for c in j.completions.values() if c > 1),
                served_classes=dict(sorted(j.served_class.items())),
            ))
        return out


def _status(job: _Batch) -> str:
    """OpenAI's word for how the job ended (``in_progress`` if the run ended first)."""
    if not job.ended:
        return "in_progress"
    return "expired" if job.expired else "completed"
