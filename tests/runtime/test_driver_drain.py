"""The driver's drain: what has not begun ends at once (at the engine too), what runs goes on,
and ``settled`` returns once nothing is left."""

from __future__ import annotations

import asyncio
from typing import Any

from qosgate.config import default_config
from qosgate.core import QosInputs, ReplicaSpec, Scheduler, State
from qosgate.runtime.driver import Driver, Ticket
from qosgate.runtime.ports import Call, Health
from qosgate.wire.engine_request import EngineRequest
from tests.support.classes import with_reserve


class GatedEngine:
    """An engine whose calls begin their answer when ``begin[rid]`` is set and end when
    ``end[rid]`` is; it records which calls were cancelled (aborted at the engine)."""

    name = "gated"
    max_window = 2
    pausable = False
    resumes = False
    ordered = False

    def __init__(self, remote: bool) -> None:
        self.remote = remote
        self.begin: dict[str, asyncio.Event] = {}
        self.end: dict[str, asyncio.Event] = {}
        self.aborted: list[str] = []

    @property
    def ready(self) -> bool:
        return True

    def models(self) -> list[str]:
        return ["m"]

    def model_cards(self) -> list[dict[str, Any]]:
        return [{"id": "m"}]

    def check_body(self, body: bytes, route: str) -> None:
        return None

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def probe(self) -> Health:
        return Health(up=True, models=("m",))

    async def run(self, call: Call) -> None:
        rid = call.engine_request.rid
        try:
            await self.begin.setdefault(rid, asyncio.Event()).wait()
            await call.sink.start(200, [])
            await call.sink.send(b"token", True)
            await self.end.setdefault(rid, asyncio.Event()).wait()
            await call.sink.send(b"", False)
        except asyncio.CancelledError:
            self.aborted.append(rid)
            raise
        call.done(1)

    def pause(self, rid: str) -> None:
        pass

    def resume(self, rid: str) -> None:
        pass


class Sink:
    def __init__(self) -> None:
        self.started = False
        self.complete = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True

    async def send(self, data: bytes, more: bool = True) -> None:
        self.complete = not more


async def _until(cond: Any, turns: int = 10_000) -> None:
    """Let the loop turn until ``cond()`` holds (bounded: a broken driver fails, not hangs)."""
    for _ in range(turns):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError("the condition never held")


def _drained(remote: bool) -> tuple[dict[str, Ticket], GatedEngine, tuple[int, int], bool]:
    """Three requests on a window of 2 -- one running, one sent but not begun, one queued --
    then the drain; the running one ends after it. What ended, what the engine aborted, the
    drain's counts, and whether ``settled`` returned before the running one ended."""

    async def run() -> tuple[dict[str, Ticket], GatedEngine, tuple[int, int], bool]:
        eng = GatedEngine(remote)
        # (no reserve: api takes both slots)
        sched = Scheduler(default_config(classes=with_reserve(0.0)), None,
                          [ReplicaSpec("gated", 2)])
        drv = Driver(sched, {"gated": eng})
        await drv.start()
        tickets: dict[str, Ticket] = {}
        for rid in ("running", "at engine", "queued"):
            req = sched.make_request(rid, QosInputs(qos_class="api"), drv.clock(), 10, 4)
            engine_request = EngineRequest(rid=rid, route="completions", body=b"{}",
                                           stream=True, model="m", max_tokens=4,
                                           prompt_tokens=10)
            tickets[rid] = drv.ticket(req, engine_request, Sink())
            drv.submit(tickets[rid])
        eng.begin.setdefault("running", asyncio.Event()).set()
        await _until(lambda: tickets["running"].req.state is State.RUNNING)
        assert tickets["at engine"].req.state is State.DISPATCHED
        assert tickets["queued"].req.state is State.QUEUED

        counts = drv.drain("shutting_down")
        settling = asyncio.ensure_future(drv.settled())
        await _until(lambda: tickets["queued"].finished.done())
        if remote:
            await _until(lambda: "at engine" in eng.aborted)
        else:
            eng.begin["at engine"].set()
            eng.end.setdefault("at engine", asyncio.Event()).set()
        settled_early = settling.done()
        eng.end.setdefault("running", asyncio.Event()).set()
        await asyncio.wait_for(settling, 5)
        await drv.close()
        return tickets, eng, counts, settled_early

    return asyncio.run(run())


def test_drain_ends_what_has_not_begun_and_settles_once_the_running_end() -> None:
    tickets, eng, counts, settled_early = _drained(remote=True)
    assert counts == (1, 1)
    for rid in ("at engine", "queued"):
        req = tickets[rid].req
        assert req.state is State.CANCELLED and req.reason == "shutting_down", rid
    assert eng.aborted == ["at engine"]
    assert not settled_early
    assert tickets["running"].req.state is State.COMPLETED


def test_in_process_a_request_sent_is_begun_and_runs_on() -> None:
    """In this process, a request sent to the engine is being computed: the drain leaves it."""
    tickets, eng, counts, settled_early = _drained(remote=False)
    assert counts == (1, 0)
    assert tickets["queued"].req.reason == "shutting_down"
    assert eng.aborted == [] and not settled_early
    for rid in ("running", "at engine"):
        assert tickets[rid].req.state is State.COMPLETED, rid
