"""The replay in real time: each planned request sent at its instant (open loop: nothing waits
for an earlier answer), a refused one sent again after its ``Retry-After`` while it has retries
left, everything bounded by ``max_seconds``. Every attempt ends with exactly one ``Attempt``."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from qosgate.measure import Answer, send
from qosgate.replay.bodies import body, head
from qosgate.replay.plan import Planned
from qosgate.runtime.upstream.transport import Pool


@dataclass(slots=True)
class Attempt:
    """One request sent (a first attempt or a retry) and its answer."""

    planned: Planned
    rid: str
    attempt: int  # 0 first
    sent_at: float  # seconds after the start
    answer: Answer = field(default_factory=Answer)

    @property
    def retry_of(self) -> str:
        return self.planned.rid if self.attempt else ""


@dataclass(slots=True, frozen=True)
class Target:
    url: str  # base URL, e.g. http://127.0.0.1:8000
    model: str
    token_prompts: bool
    retries: int = 0
    max_seconds: float = 600.0
    timeout_s: float = 600.0  # one request's own bound
    prompt_seed: str = ""  # the prompts' tokens (``bodies``): a new one per replay by default
    ignore_eos: bool = True


# on_event(sent, done): the progress bar's counts
Progress = Callable[[int, int], None]


async def replay(plan: list[Planned], target: Target,
                 progress: Progress | None = None) -> list[Attempt]:
    """Send ``plan`` to ``target``; return every attempt, in the order they were sent."""
    u = urlsplit(target.url)
    pool = Pool(target.url, connect_timeout_s=10.0, api_key=None)
    host = u.netloc
    prefix = u.path.rstrip("/")
    t0 = time.monotonic()
    attempts: list[Attempt] = []
    tasks: set[asyncio.Task[None]] = set()
    done = 0

    def tick() -> None:
        if progress is not None:
            progress(len(attempts), done)

    async def one(p: Planned, k: int, due: float) -> None:
        nonlocal done
        delay = due - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        rid = p.rid if k == 0 else f"{p.rid}.retry{k}"
        att = Attempt(p, rid, k, time.monotonic() - t0)
        attempts.append(att)
        tick()
        path, data = body(p, target.model, target.token_prompts, target.prompt_seed,
                          target.ignore_eos)
        try:
            async with asyncio.timeout(target.timeout_s):
                await send(pool, head(prefix, host, path, att.planned), data, t0, att.answer)
        except TimeoutError:
            pass  # ``send`` recorded it as cancelled
        done += 1
        tick()
        ans = att.answer
        if (ans.state == "rejected" and ans.retry_after is not None and k < target.retries):
            again = time.monotonic() - t0 + ans.retry_after
            if again < target.max_seconds:
                spawn(p, k + 1, again)

    def spawn(p: Planned, k: int, due: float) -> None:
        task = asyncio.create_task(one(p, k, due))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    for p in plan:
        if p.t < target.max_seconds:
            spawn(p, 0, p.t)
    try:
        async with asyncio.timeout(target.max_seconds):
            while tasks:
                await asyncio.wait(set(tasks))
    except TimeoutError:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        pool.close()
    return sorted(attempts, key=lambda a: a.sent_at)
