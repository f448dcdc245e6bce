"""``BatchingEngine`` on its own (no gateway): embeddings calls collected at ``start_call`` and
run as one ``run_batch`` when the batcher says; other calls straight through; a call withdrawn
while it waits never reaches the engine; a batch's calls end with it; the linger's timer fires."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any

from qosgate.core.batching import Batcher, BatchLimits, FixedLinger
from qosgate.core.facts import AttemptFailed
from qosgate.runtime.batching import BatchingEngine
from qosgate.runtime.ports import Health
from qosgate.wire.engine_request import EngineRequest, Route, Unservable


class _Call:
    def __init__(self, rid: str, route: Route = "embeddings", level: int = 1) -> None:
        self.engine_request = EngineRequest(rid=rid, route=route, body=b"{}", stream=False,
                                            model="m", max_tokens=1, prompt_tokens=4,
                                            inputs=["x"])
        self._level = level
        self.sink: Any = None

    def order(self) -> int:
        return 0

    def levels(self) -> int:
        return 2

    def level(self) -> int:
        return self._level

    def progress(self, tokens: int) -> None: ...

    def first_token(self) -> None: ...

    def done(self, output_tokens: int, prompt_tokens: int | None = None,
             cached_tokens: int | None = None) -> None: ...

    def failed(self, reason: str, output_tokens: int = 0) -> None: ...

    def attempt_failed(self, fact: AttemptFailed) -> None: ...

    def timed_out(self, reason: str) -> None: ...

    def refused(self, status: int, body: bytes) -> None: ...

    transcript = None

    def moved(self, fact: AttemptFailed) -> None: ...

    def unresumable(self) -> None: ...

    def continued(self, prompt_tokens: int, cached_tokens: int | None) -> None: ...


class _Inner:
    name = "e0"
    max_window = 8
    pausable = False
    resumes = False
    ordered = False
    remote = False
    ready = True

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.runs: list[str] = []

    def models(self) -> list[str]:
        return ["m"]

    def model_cards(self) -> list[dict[str, Any]]:
        return []

    def check_body(self, body: bytes, route: Route) -> Unservable | None:
        return None

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def probe(self) -> Health:
        return Health(up=True)

    async def run(self, call: Any) -> None:
        self.runs.append(call.engine_request.rid)

    def pause(self, rid: str) -> None: ...

    def resume(self, rid: str) -> None: ...

    async def run_batch(self, calls: list[Any]) -> None:
        self.batches.append([c.engine_request.rid for c in calls])
        await asyncio.sleep(0)


def _engine(linger_s: float, max_batch: int = 3) -> tuple[BatchingEngine, _Inner]:
    inner = _Inner()
    eng = BatchingEngine(inner, Batcher(BatchLimits(max_batch=max_batch), FixedLinger(linger_s)),
                         lambda: True, time.monotonic)
    return eng, inner


def _task(coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(coro)


def test_a_batch_on_size_other_routes_straight_through_and_calls_end_with_their_batch() -> None:
    async def run() -> tuple[_Inner, list[bool]]:
        eng, inner = _engine(10.0)
        tasks = [_task(eng.start_call(_Call(f"e{i}"))) for i in range(3)]  # size 3: released
        chat = _task(eng.start_call(_Call("c", route="chat")))
        await asyncio.wait_for(asyncio.gather(*tasks, chat), 5)
        await eng.close()
        return inner, [t.done() for t in tasks]

    inner, done = asyncio.run(run())
    assert inner.batches == [["e0", "e1", "e2"]] and inner.runs == ["c"]
    assert all(done)


def test_a_withdrawn_call_leaves_the_batcher_and_the_linger_timer_releases_the_rest() -> None:
    async def run() -> tuple[BatchingEngine, _Inner]:
        eng, inner = _engine(0.05)
        kept = _task(eng.start_call(_Call("a")))
        gone = _task(eng.start_call(_Call("b")))
        await asyncio.sleep(0)  # both wait for their batch
        gone.cancel()  # pulled back: the driver cancels its task
        await asyncio.wait_for(kept, 5)  # the linger's timer released the batch
        await eng.close()
        return eng, inner

    eng, inner = asyncio.run(run())
    assert inner.batches == [["a"]]
    assert eng.stats.released == {"window": 1} and eng.stats.size_sum == 1
    assert len(eng.batcher) == 0


def test_an_urgent_call_skips_the_linger() -> None:
    async def run() -> _Inner:
        eng, inner = _engine(10.0)
        await asyncio.wait_for(_task(eng.start_call(_Call("rt", level=0))), 5)
        await eng.close()
        return inner

    assert asyncio.run(run()).batches == [["rt"]]


def test_a_call_cancelled_before_its_task_ever_ran_is_not_batched() -> None:
    async def run() -> tuple[BatchingEngine, _Inner]:
        eng, inner = _engine(0.05)
        gone = _task(eng.start_call(_Call("b")))
        gone.cancel()  # before its first step: its coroutine never runs
        kept = _task(eng.start_call(_Call("a")))
        await asyncio.wait_for(kept, 5)
        await eng.close()
        return eng, inner

    eng, inner = asyncio.run(run())
    assert inner.batches == [["a"]] and len(eng.batcher) == 0
