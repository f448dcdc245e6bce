"""The feeder: runs the lines of the jobs this gateway owns through the scheduler, on spare
capacity, each line answered once.

One asyncio task. It wakes when a job is created or cancelled (``notify``), when a line ends,
and at its timers (a retry due, a group of answers to write, the periodic sweep that picks up
jobs, renews leases and ends expired jobs) -- never by polling.

Per owned job: ``validating`` -> ``store.validate``; ``in_progress`` -> lines offered per
``core.batches_feed.plan`` (a bounded number; the scheduler decides who runs), their answers written
in group commits (``record``: one transaction per group, so the disk is not one write per line);
all answered -> ``completed``; ``cancelling`` or past ``expires_at`` -> running lines are
disconnected (the flow aborts them at the engine), what finished is kept, the job ends
``cancelled`` / ``expired``. A write refused with ``Fenced`` (or a lease not renewed) means
another instance owns the job now: its lines stop here and it is dropped (said once per job:
a job that changes hands again and again is logged once, then at debug level).

Exactly once: a line is offered only if it has no recorded answer and is not running, backing
off, or answered-but-not-yet-written here; after a restart only lines without an answer run
again. The line runner is passed in (``LineRunner``: the server runs a line as a request of the
job's tenant through its own ``RequestFlow``), so this module knows nothing of HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Protocol

from qosgate.core.batches_feed import (
    SWEEP_S,
    FeedBatch,
    Next,
    RetryRule,
    SpareCapacity,
    after_failure,
    plan,
)
from qosgate.runtime.batches.lease import Lease
from qosgate.runtime.batches.records import (
    TERMINAL,
    BatchRecord,
    BatchStatus,
    Fenced,
    LineResult,
    LineTask,
)
from qosgate.runtime.batches.store import BatchStore
from qosgate.settings import BatchSettings

__all__ = ["Feeder", "FeederStats", "LineAnswer", "LineRunner"]

log = logging.getLogger("qosgate.batches")


@dataclass(frozen=True, slots=True)
class LineAnswer:
    """What running a line gave: its response (``status`` None: none, e.g. it was stopped)."""

    status: int | None
    body: bytes = b""
    retry_after_s: float | None = None
    request_id: str = ""


class LineRunner(Protocol):
    async def __call__(self, job: BatchRecord, task: LineTask,
                       stop: asyncio.Event) -> LineAnswer:
        """Run one line as a request of ``job``'s tenant at its class; setting ``stop`` ends it
        (a running request is aborted at its engine)."""
        ...


@dataclass(slots=True)
class FeederStats:
    """What the status page and /metrics read: jobs owned by status, lines by outcome since
    start, and lines in flight per job."""

    jobs: dict[str, int] = field(default_factory=dict)
    lines: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("completed", "failed", "retried", "waited", "expired", "cancelled"), 0))
    in_flight: dict[str, int] = field(default_factory=dict)
    spare: int = 0  # the slots live traffic left free at the last look
    stored: dict[str, int] = field(default_factory=dict)  # the store's stats (every job's)


@dataclass(slots=True)
class _Batch:
    rec: BatchRecord
    fence: int
    running: dict[int, tuple[asyncio.Task[None], asyncio.Event]] = field(default_factory=dict)
    waiting: dict[int, tuple[float, LineTask]] = field(default_factory=dict)  # retry at
    answered: dict[int, LineResult] = field(default_factory=dict)  # not yet written
    first_answer_at: float = math.inf  # monotonic: when the oldest unwritten answer came
    exhausted: bool = False  # the store had no more lines to offer beyond ours
    lost: bool = False


class Feeder:
    def __init__(
        self,
        store: BatchStore,
        run_line: LineRunner,
        lease: Lease,
        settings: BatchSettings,
        capacity: Callable[[], int],
        serves: Callable[[str], bool],
        in_flight: Callable[[], int],
        wall: Callable[[], float],
        clock: Callable[[], float],
        seed: int | None = None,
        flush_lines: int = 64,
        flush_s: float = 0.005,
        sweep_s: float = SWEEP_S,
    ) -> None:
        """``capacity``: how many requests the serving replicas run at once (their windows);
        ``in_flight``: every request queued or running in the scheduler (job lines too: the
        feeder subtracts its own to see live traffic);
        ``serves(model)``: is the model served (validation); ``wall``: Unix time (deadlines);
        ``clock``: monotonic (timers). Answers are written once ``flush_lines`` are waiting or
        the oldest has waited ``flush_s``."""
        self.store = store
        self.run_line = run_line
        self.lease = lease
        self.settings = settings
        self.capacity = capacity
        self.serves = serves
        self.in_flight = in_flight
        self.spare = SpareCapacity(settings.live_span_s, settings.headroom)
        self._spare = 0
        self._stored: dict[str, int] = {}  # store.stats(), read at each sweep (for /metrics)
        self.wall = wall
        self.clock = clock
        self.rule = RetryRule(settings.retries, settings.backoff_s, settings.backoff_max_s)
        self.rng = random.Random(seed)
        self.flush_lines = flush_lines
        self.flush_s = flush_s
        self.sweep_s = min(sweep_s, lease.renew_every_s)
        self.jobs: dict[str, _Batch] = {}
        self._lost: set[str] = set()  # live jobs lost to another owner (logged once each)
        self.counts = FeederStats().lines
        self._wake = asyncio.Event()
        self._dirty = True  # the store's job list changed (created, cancelled): read it again
        self._next_sweep = -math.inf
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._paused = False

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._main(), name="batch-feeder")

    async def stop(self) -> None:
        """Stop feeding: running lines are disconnected (they run again after a restart: no
        answer was recorded), answers already in are written, leases released."""
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for job in list(self.jobs.values()):
            await self._stop_lines(job)
            with contextlib.suppress(Fenced):
                await self._flush(job)
            with contextlib.suppress(Exception):
                await self.lease.release(job.rec.id)
        self.jobs.clear()
        await self.lease.close()

    def pause(self) -> None:
        """Start no more lines (a draining gateway): the running ones end and are written."""
        self._paused = True

    def notify(self, batch_id: str | None = None) -> None:
        """A job was created or asked to cancel (the HTTP routes' hook): look again now."""
        self._dirty = True
        self._wake.set()

    def snapshot(self) -> FeederStats:
        jobs: dict[str, int] = {}
        for j in self.jobs.values():
            jobs[j.rec.status] = jobs.get(j.rec.status, 0) + 1
        return FeederStats(jobs, dict(self.counts),
                           {j.rec.id: len(j.running) for j in self.jobs.values()},
                           self._spare, dict(self._stored))

    # ------------------------------------------------------------------ the loop
    async def _main(self) -> None:
        while not self._stopping:
            try:
                await self._step()
            except Exception:  # a store that failed once must not end batch work for good
                log.exception("the batch feeder's step failed")
                await asyncio.sleep(self.sweep_s)
            timeout = max(0.0, self._next_due() - self.clock())
            if self._wake.is_set() or self._stopping:
                self._wake.clear()
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()

    def _next_due(self) -> float:
        due = self._next_sweep
        for job in self.jobs.values():
            if job.answered:
                due = min(due, job.first_answer_at + self.flush_s)
            for at, _ in job.waiting.values():
                due = min(due, at)
        return due

    async def _step(self) -> None:
        now = self.clock()
        if self._dirty or now >= self._next_sweep:
            await self._sweep(renew=now >= self._next_sweep)
        for job in list(self.jobs.values()):
            await self._guard(job, self._drive(job))
        feedable = [j for j in self.jobs.values() if j.rec.status == "in_progress"]
        if self._paused:
            for job in feedable:
                await self._guard(job, self._feed(job, 0, now))
            return
        ours = sum(len(j.running) for j in self.jobs.values())
        self.spare.observe(now, max(self.in_flight() - ours, 0))
        self._spare = self.spare.spare(now, self.capacity())
        grants = dict(plan([self._feed_view(j, now) for j in feedable],
                           self.settings.queued_per_job, self._spare))
        for job in feedable:
            await self._guard(job, self._feed(job, grants.get(job.rec.id, 0), now))

    async def _guard(self, job: _Batch, work: Coroutine[None, None, None]) -> None:
        """Run ``work`` for ``job``; a job found lost to another owner stops here."""
        try:
            if not job.lost and job.rec.id in self.jobs:
                await work
            else:
                work.close()
        except Fenced:
            job.lost = True
        if job.lost and self.jobs.pop(job.rec.id, None) is not None:
            again = job.rec.id in self._lost
            self._lost.add(job.rec.id)
            log.log(logging.DEBUG if again else logging.WARNING,
                    "batch %s: another instance owns it now; its lines stop here", job.rec.id)
            await self._stop_lines(job)

    async def _sweep(self, renew: bool) -> None:
        """Pick up live jobs not yet ours, read their states again, renew leases."""
        self._dirty = False
        if renew:
            self._next_sweep = self.clock() + self.sweep_s
            for job in list(self.jobs.values()):
                if not await self.lease.renew(job.rec.id):
                    job.lost = True
            self._stored = await self.store.stats()
        live = await self.store.live()
        self._lost.intersection_update(rec.id for rec in live)  # ended jobs are forgotten
        for rec in live:
            mine = self.jobs.get(rec.id)
            if mine is not None:
                mine.rec = rec
                if rec.fence > mine.fence:  # claimed by another since
                    mine.lost = True
                continue
            fence = await self.lease.acquire(rec.id, rec.fence)
            if fence is None:
                continue
            if not await self.store.claim(rec.id, fence):
                await self.lease.release(rec.id)
                continue
            self.jobs[rec.id] = _Batch(dataclasses.replace(rec, fence=fence), fence)

    async def _drive(self, job: _Batch) -> None:
        if job.lost:
            return
        rec = job.rec
        if rec.status == "validating":
            job.rec = await self.store.validate(rec.id, self.serves, job.fence)
            if job.rec.status in TERMINAL:
                await self._drop(job)
            return
        if rec.status == "cancelling":
            await self._end(job, "cancelled")
            return
        if rec.status == "finalizing":  # a finish a crash interrupted: done again
            job.rec = await self.store.finish(rec.id, job.fence, "completed")
            await self._drop(job)
            return
        if rec.status != "in_progress":
            if rec.status in TERMINAL:
                await self._drop(job)
            return
        if self.wall() >= rec.expires_at:
            await self._end(job, "expired")
            return

    def _feed_view(self, job: _Batch, now: float) -> FeedBatch:
        due = sum(1 for at, _ in job.waiting.values() if at <= now)
        ready = due + (0 if job.exhausted else self.settings.max_lines)
        return FeedBatch(job.rec.id, job.rec.tenant, job.rec.expires_at, len(job.running), ready)

    async def _feed(self, job: _Batch, granted: int, now: float) -> None:
        """Write answers that are due, offer the job ``granted`` lines (retries due first), and
        end it once every line is answered."""
        if job.answered and (len(job.answered) >= self.flush_lines
                             or now >= job.first_answer_at + self.flush_s):
            await self._flush(job)
        if granted > 0:
            due = [t for at, t in job.waiting.values() if at <= now][:granted]
            for t in due:
                del job.waiting[t.line]
                self._launch(job, t)
            want = granted - len(due)
            if want > 0 and not job.exhausted:
                skip = [*job.running, *job.waiting, *job.answered]
                tasks = await self.store.next_lines(job.rec.id, want, skip)
                if len(tasks) < want:
                    job.exhausted = True
                for t in tasks:
                    if t.line not in job.running and job.rec.id in self.jobs:
                        self._launch(job, t)
        if not job.running and not job.waiting and job.exhausted:
            await self._flush(job)
            # nothing of ours is pending: one look with nothing skipped tells whether all are in
            if await self.store.next_lines(job.rec.id, 1, ()):
                job.exhausted = False
                return
            job.rec = await self.store.finish(job.rec.id, job.fence, "completed")
            await self._drop(job)

    def _launch(self, job: _Batch, task: LineTask) -> None:
        stop = asyncio.Event()
        run = asyncio.get_running_loop().create_task(self._run(job, task, stop))
        job.running[task.line] = (run, stop)

    async def _run(self, job: _Batch, task: LineTask, stop: asyncio.Event) -> None:
        try:
            ans = await self.run_line(job.rec, task, stop)
        except Exception as exc:  # a bug in running one line is that line's engine failure
            log.exception("batch %s line %d failed in the gateway", job.rec.id, task.line)
            ans = LineAnswer(None, str(exc).encode())
        try:
            if stop.is_set() and ans.status is None:
                return  # stopped: no answer, it runs again if the job goes on elsewhere
            await self._settle(job, task, ans)
        finally:
            job.running.pop(task.line, None)
            self._wake.set()

    async def _settle(self, job: _Batch, task: LineTask, ans: LineAnswer) -> None:
        status = ans.status
        if status is not None and 200 <= status < 300:
            self._answer(job, LineResult(job.rec.id, task.line, ans.request_id, status, ans.body))
            return
        v = after_failure(status, ans.retry_after_s, task.attempts, self.clock(), self.rule,
                          self.rng)
        if v.next is Next.FINAL:
            if status is None:
                self._answer(job, LineResult(
                    job.rec.id, task.line, ans.request_id, error_code="engine_error",
                    error_message="The line failed without a response after "
                    f"{task.attempts + 1} attempt(s)."))
            else:
                self._answer(job, LineResult(job.rec.id, task.line, ans.request_id, status,
                                             ans.body))
            return
        if v.next is Next.RETRY:
            try:
                await self.store.count_attempt(job.rec.id, task.line, job.fence)
            except Fenced:
                job.lost = True
                return
            task = dataclasses.replace(task, attempts=task.attempts + 1)
            self.counts["retried"] += 1
        else:
            self.counts["waited"] += 1
        job.waiting[task.line] = (v.at, task)

    def _answer(self, job: _Batch, result: LineResult) -> None:
        if not job.answered:
            job.first_answer_at = self.clock()
        job.answered[result.line] = result
        self.counts["completed" if result.ok else "failed"] += 1

    async def _flush(self, job: _Batch) -> None:
        """Write the answers in, in one transaction (``Fenced`` if the job is no longer ours)."""
        if not job.answered:
            return
        results = list(job.answered.values())
        await self.store.record(job.fence, results)
        for r in results:
            job.answered.pop(r.line, None)
        job.first_answer_at = math.inf if not job.answered else self.clock()

    async def _stop_lines(self, job: _Batch) -> None:
        """Disconnect every running line and wait for each to end (answers that raced in are
        kept to be written)."""
        for _, stop in job.running.values():
            stop.set()
        tasks = [t for t, _ in job.running.values()]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        job.waiting.clear()

    async def _end(self, job: _Batch, status: BatchStatus) -> None:
        """Cancelled or expired: stop its lines, keep what finished, end it."""
        await self._stop_lines(job)
        await self._flush(job)
        rec = await self.store.batch(job.rec.id, None)
        before = rec.completed + rec.failed if rec is not None else 0
        job.rec = await self.store.finish(job.rec.id, job.fence, status)
        self.counts["cancelled" if status == "cancelled" else "expired"] += max(
            0, job.rec.total - before)
        await self._drop(job)

    async def _drop(self, job: _Batch) -> None:
        self.jobs.pop(job.rec.id, None)
        await self.lease.release(job.rec.id)
