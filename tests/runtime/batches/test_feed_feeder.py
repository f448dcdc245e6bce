"""The feeder's rules against an in-memory store and a scripted line runner: every line answered
once, retries and waits, cancel, expiry, a lost lease, bounded lines in flight."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence

import pytest

from qosgate.runtime.batches.feeder import Feeder, LineAnswer
from qosgate.runtime.batches.lease import LocalLease
from qosgate.runtime.batches.records import (
    TERMINAL,
    BatchError,
    BatchRecord,
    BatchStatus,
    Fenced,
    LineResult,
    LineTask,
)
from qosgate.settings import BatchSettings


class MemoryStore:
    """The store's feeder-side contract, in memory (the real one is SQLite)."""

    def __init__(self, lines: int, completion_window_s: float = 3600.0) -> None:
        self.rec = BatchRecord("batch_1", "t", "/v1/chat/completions", "file-1", "24h",
                               "validating", "batch", 0, int(completion_window_s), total=0)
        self.n = lines
        self.answers: dict[int, LineResult] = {}
        self.writes: list[int] = []  # lines per record() call
        self.attempts: dict[int, int] = {}

    def _fenced(self, fence: int) -> None:
        if fence < self.rec.fence:
            raise Fenced

    async def live(self) -> list[BatchRecord]:
        return [] if self.rec.status in TERMINAL else [self.rec]

    async def claim(self, batch_id: str, fence: int) -> bool:
        if fence <= self.rec.fence:
            return False
        self.rec = dataclasses.replace(self.rec, fence=fence)
        return True

    async def validate(self, batch_id: str, serves: Callable[[str], bool],
                       fence: int) -> BatchRecord:
        self._fenced(fence)
        self.rec = dataclasses.replace(self.rec, status="in_progress", total=self.n)
        return self.rec

    async def batch(self, batch_id: str, tenant: str | None) -> BatchRecord | None:
        return self.rec

    async def next_lines(self, batch_id: str, n: int, skip: Sequence[int]) -> list[LineTask]:
        out = []
        for i in range(self.n):
            if len(out) >= n:
                break
            if i not in self.answers and i not in skip:
                out.append(LineTask(batch_id, i, f"req-{i}", "/v1/chat/completions", b"{}",
                                    self.attempts.get(i, 0), i))
        return out

    async def record(self, fence: int, results: Sequence[LineResult]) -> int:
        self._fenced(fence)
        new = [r for r in results if r.line not in self.answers]
        assert len(new) == len(results), "a line answered twice"
        for r in new:
            self.answers[r.line] = r
        self.writes.append(len(new))
        ok = sum(1 for r in self.answers.values() if r.ok)
        self.rec = dataclasses.replace(self.rec, completed=ok, failed=len(self.answers) - ok)
        return len(new)

    async def stats(self) -> dict[str, int]:
        return {f"jobs_{self.rec.status}": 1}

    async def count_attempt(self, batch_id: str, line: int, fence: int) -> None:
        self._fenced(fence)
        self.attempts[line] = self.attempts.get(line, 0) + 1

    async def finish(self, batch_id: str, fence: int, status: BatchStatus,
                     errors: Sequence[BatchError] = ()) -> BatchRecord:
        self._fenced(fence)
        self.rec = dataclasses.replace(self.rec, status=status)
        return self.rec


class Runner:
    """Answers lines by a script (line -> list of answers, one per run); default 200."""

    def __init__(self, script: dict[int, list[LineAnswer]] | None = None,
                 hold: asyncio.Event | None = None) -> None:
        self.script = script or {}
        self.hold = hold  # while unset, lines wait (as in a queue) until stopped
        self.runs: dict[int, int] = {}
        self.running = 0
        self.most = 0

    async def __call__(self, job: BatchRecord, task: LineTask,
                       stop: asyncio.Event) -> LineAnswer:
        self.runs[task.line] = self.runs.get(task.line, 0) + 1
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            if self.hold is not None:
                waiter = asyncio.ensure_future(stop.wait())
                held = asyncio.ensure_future(self.hold.wait())
                await asyncio.wait([waiter, held], return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                held.cancel()
                if stop.is_set():
                    return LineAnswer(None)
            await asyncio.sleep(0)
            todo = self.script.get(task.line)
            if todo:
                return todo.pop(0)
            return LineAnswer(200, b'{"ok": true}', request_id=f"r{task.line}")
        finally:
            self.running -= 1


# live traffic watched over 10 ms: a feeder that has just started has watched a whole lookback
# almost at once (the tests of the spare slots themselves shift the clock instead)
SETTINGS = BatchSettings(queued_per_job=4, retries=2, backoff_s=0.001, backoff_max_s=0.004,
                         live_span_s=0.01)


def feeder(store: MemoryStore, runner: Runner, wall: Callable[[], float] = lambda: 1.0,
           capacity: int = 8, live: Callable[[], int] = lambda: 0,
           settings: BatchSettings = SETTINGS,
           clock: Callable[[], float] | None = None) -> Feeder:
    """A feeder whose scheduler holds its own running lines plus ``live()`` live requests."""
    loop = asyncio.get_running_loop()
    return Feeder(store, runner, LocalLease(), settings, lambda: capacity,  # type: ignore[arg-type]
                  lambda m: True, lambda: runner.running + live(), wall, clock or loop.time,
                  seed=1, sweep_s=0.01)


async def until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.001)


def test_every_line_answered_once_in_group_writes_within_the_bound() -> None:
    async def run() -> None:
        store, runner = MemoryStore(300), Runner()
        f = feeder(store, runner)
        f.start()
        await until(lambda: store.rec.status == "completed")
        await f.stop()
        assert sorted(store.answers) == list(range(300))
        assert set(runner.runs.values()) == {1}
        assert runner.most <= SETTINGS.queued_per_job + 8
        assert len(store.writes) < 300  # answers are written in groups
        assert f.snapshot().lines["completed"] == 300

    asyncio.run(run())


def test_live_traffic_keeps_its_peak_and_a_headroom_of_the_fleet() -> None:
    async def run() -> None:
        store, hold = MemoryStore(100), asyncio.Event()
        runner = Runner(hold=hold)
        live = [5]
        loop = asyncio.get_running_loop()
        shift = [0.0]
        f = feeder(store, runner, capacity=8, live=lambda: live[0],
                   settings=SETTINGS.model_copy(update={"live_span_s": 30.0}),
                   clock=lambda: loop.time() + shift[0])
        f.start()
        await until(lambda: f.spare._since is not None)
        assert runner.running <= SETTINGS.queued_per_job  # nothing watched yet: no spare slot
        shift[0] = 31.0  # a whole lookback watched
        f.notify()
        # 8 slots, 5 live, 1 kept free (5% of 8, at least one): 2 spare, plus the queue
        await until(lambda: runner.running == 2 + SETTINGS.queued_per_job)
        live[0] = 0  # the burst is over, but within the lookback it still counts
        f.notify()
        for _ in range(50):
            await asyncio.sleep(0)
        assert runner.running == 2 + SETTINGS.queued_per_job
        hold.set()
        await until(lambda: store.rec.status == "completed")
        await f.stop()
        assert sorted(store.answers) == list(range(100))

    asyncio.run(run())


def test_engine_failures_retry_then_land_final_and_waits_spend_no_attempt() -> None:
    async def run() -> None:
        fail = LineAnswer(500, b'{"error": {}}')
        wait = LineAnswer(429, b'{"error": {}}', retry_after_s=0.001)
        bad = LineAnswer(400, b'{"error": {"message": "no"}}')
        script = {1: [fail, fail, fail, fail], 2: [fail, wait, wait, wait, wait],
                  3: [bad, bad]}
        store, runner = MemoryStore(10), Runner(script)
        f = feeder(store, runner)
        f.start()
        await until(lambda: store.rec.status == "completed")
        await f.stop()
        assert runner.runs[1] == 3 and store.answers[1].status_code == 500  # 1 + 2 retries
        assert store.attempts[1] == 2
        assert runner.runs[2] == 6 and store.answers[2].ok and store.attempts[2] == 1
        assert runner.runs[3] == 1 and store.answers[3].status_code == 400
        assert store.rec.completed == 8 and store.rec.failed == 2

    asyncio.run(run())


def test_cancel_stops_running_lines_and_keeps_the_finished() -> None:
    async def run() -> None:
        store, hold = MemoryStore(100), asyncio.Event()
        runner = Runner(hold=hold)
        f = feeder(store, runner)
        f.start()
        await until(lambda: runner.running == SETTINGS.queued_per_job + 8)
        assert store.answers == {}
        store.rec = dataclasses.replace(store.rec, status="cancelling")
        f.notify(store.rec.id)
        await until(lambda: store.rec.status == "cancelled")
        await f.stop()
        assert runner.running == 0 and store.answers == {}
        assert f.snapshot().lines["cancelled"] == 100

    asyncio.run(run())


def test_a_job_past_its_completion_window_ends_expired_keeping_what_finished() -> None:
    async def run() -> None:
        now = [1.0]
        store = MemoryStore(50, completion_window_s=10)
        runner = Runner({i: [LineAnswer(200, b"{}")] for i in range(50)})
        hold = asyncio.Event()
        runner.hold = hold
        f = feeder(store, runner, wall=lambda: now[0])
        f.start()
        await until(lambda: runner.running == SETTINGS.queued_per_job + 8)
        hold.set()  # the first lines finish; later ones are held again
        await until(lambda: len(runner.runs) > 12)
        runner.hold = asyncio.Event()
        await until(lambda: runner.running > 0)
        now[0] = 11.0
        await until(lambda: store.rec.status == "expired")
        await f.stop()
        assert 12 <= len(store.answers) < 50
        assert all(runner.runs[i] == 1 for i in store.answers)

    asyncio.run(run())


def test_a_fenced_write_drops_the_job_and_stops_its_lines() -> None:
    async def run() -> None:
        store, hold = MemoryStore(100), asyncio.Event()
        runner = Runner(hold=hold)
        f = feeder(store, runner)
        f.start()
        await until(lambda: runner.running > 0)
        store.rec = dataclasses.replace(store.rec, fence=store.rec.fence + 1)  # another owner
        hold.set()
        await until(lambda: not f.jobs)
        await until(lambda: runner.running == 0)
        await f.stop()
        assert store.answers == {} and store.rec.status == "in_progress"

    asyncio.run(run())


def test_a_restart_runs_only_the_lines_without_an_answer() -> None:
    async def run() -> None:
        store, hold = MemoryStore(40), asyncio.Event()
        first = Runner({i: [LineAnswer(200, b"{}")] for i in range(40)}, hold=hold)
        f = feeder(store, first)
        f.start()
        await until(lambda: first.running == SETTINGS.queued_per_job + 8)
        hold.set()
        await until(lambda: len(store.answers) >= 5)
        first.hold = asyncio.Event()
        await f.stop()  # the lines running now have no answer
        done = set(store.answers)
        second = Runner()
        g = feeder(store, second)
        g.start()
        await until(lambda: store.rec.status == "completed")
        await g.stop()
        assert sorted(store.answers) == list(range(40))
        assert not done & set(second.runs)

    asyncio.run(run())


def test_a_job_lost_again_and_again_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """Two feeders that each think they own every job (two gateways alone on one directory,
    which the directory's lock now refuses) take the job from each other at every sweep: each
    says so once, then only at debug level."""
    caplog.set_level(logging.DEBUG, logger="qosgate.batches")

    def losses(*levels: int) -> list[logging.LogRecord]:
        return [r for r in caplog.records
                if r.levelno in levels and "another instance owns it now" in r.getMessage()]

    async def run() -> None:
        store, hold = MemoryStore(100), asyncio.Event()
        a, b = feeder(store, Runner(hold=hold)), feeder(store, Runner(hold=hold))
        a.start()
        b.start()
        await until(lambda: len(losses(logging.DEBUG, logging.WARNING)) >= 8)
        await a.stop()
        await b.stop()

    asyncio.run(run())
    assert len(losses(logging.WARNING)) <= 2  # one per feeder
