"""``SinkStep``: a sink call run by hand as far as it goes, then finished by the call's task as a
task would run it (the relay's way of writing a chunk in the callback that read it)."""

from __future__ import annotations

import asyncio

import pytest

from qosgate.runtime.upstream.relay import SinkStep


def test_a_call_that_never_waits_is_done_at_once() -> None:
    out: list[int] = []

    async def call() -> None:
        out.append(1)

    async def main() -> None:
        assert SinkStep.run(call()) is None
        assert out == [1]

    asyncio.run(main())


def test_a_call_that_waits_is_finished_by_the_task_with_what_it_waited_for() -> None:
    out: list[object] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[int] = loop.create_future()

        async def call() -> None:
            out.append(await fut)
            await asyncio.sleep(0)  # a bare yield
            out.append("end")

        step = SinkStep.run(call())
        assert step is not None and step.waiting is fut and out == []
        loop.call_later(0.01, fut.set_result, 7)
        await asyncio.wait_for(step.finish(), 2)
        assert out == [7, "end"]

    asyncio.run(main())


def test_an_error_of_what_it_waited_for_is_raised_in_the_call() -> None:
    async def main() -> None:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        seen: list[BaseException] = []

        async def call() -> None:
            try:
                await fut
            except ValueError as exc:
                seen.append(exc)
                raise

        step = SinkStep.run(call())
        assert step is not None
        fut.set_exception(ValueError("x"))
        with pytest.raises(ValueError):
            await step.finish()
        assert len(seen) == 1

    asyncio.run(main())


def test_cancelling_the_task_cancels_what_the_call_waits_on_and_reaches_the_call() -> None:
    async def main() -> None:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        cleaned: list[bool] = []

        async def call() -> None:
            try:
                await fut
            finally:
                cleaned.append(True)

        step = SinkStep.run(call())
        assert step is not None
        task = asyncio.create_task(step.finish())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert fut.cancelled() and cleaned == [True]

    asyncio.run(main())
