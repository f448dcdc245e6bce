"""Any ``StepEngine`` served in real time inside the event loop.

One step loop per engine. For a *modelled* engine (the simulated GPU) a step is computed at once and
the loop sleeps its modelled duration (times ``time_scale``) before releasing the step's tokens, so
clients see the timing the model predicts. For a *real* engine (llama.cpp) ``step()`` runs in a
worker thread; control calls (add/pause/resume/abort) that arrive meanwhile are applied between two
steps, so the engine is only ever touched by one thread at a time.

Tokens fan out to one small channel per request; the request's own coroutine (``run``) formats
them as OpenAI chunks and writes them to the client. The scheduler's decisions map onto the engine:
pause/resume keep the sequence's state (a paused request resumes at the next token), cancelling
``run`` aborts the sequence and frees its slot at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any

from qosgate.asgi import JSON_HEADERS, SSE_HEADERS
from qosgate.engines.base import Call
from qosgate.engines.openai_format import Formatter
from qosgate.engines.step import FinishEvent, SeqSpec, StepEngine, StepResult

# a step that ends this little behind schedule (timer granularity) still starts on schedule
_CATCH_UP_S = 0.002


class _Channel:
    __slots__ = ("error", "finish", "tokens", "waiter")

    def __init__(self) -> None:
        self.tokens: list[str] = []
        self.finish: FinishEvent | None = None
        self.error: str | None = None
        self.waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)


class InProcessEngine:
    """Runs ``engine`` in real time and serves OpenAI requests from it (see the module doc)."""

    pausable = True

    def __init__(
        self,
        engine: StepEngine,
        *,
        name: str = "inprocess",
        capacity: int | None = None,
        models: list[str] | None = None,
        modelled_time: bool = True,
        time_scale: float = 1.0,
    ) -> None:
        self.engine = engine
        self.name = name
        self.capacity = capacity if capacity is not None else engine.max_num_seqs
        self._models = models or ["qosgate-sim"]
        self.modelled_time = modelled_time
        self.time_scale = time_scale
        self._chans: dict[str, _Channel] = {}
        self._stepping = False
        self._in_pending = False
        self._pending: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._idle: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.steps = 0

    # ------------------------------------------------------------------ Engine protocol
    @property
    def ready(self) -> bool:
        return self._task is not None and not self._task.done()

    def models(self) -> list[str]:
        return list(self._models)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def pause(self, rid: str) -> None:
        self._op(self.engine.pause, rid)

    def resume(self, rid: str) -> None:
        self._op(self.engine.resume, rid)
        self._kick()

    async def run(self, call: Call) -> None:
        job = call.job
        spec = SeqSpec(
            seq_id=job.rid,
            prompt_tokens=max(1, job.prompt_tokens),
            max_tokens=job.max_tokens,
            engine_priority=call.level(),
        )
        await self.generate(call, spec)

    # ------------------------------------------------------------------ serving one sequence
    async def generate(self, call: Call, spec: SeqSpec) -> None:
        """Add ``spec`` to the engine and serve its tokens to ``call`` until it finishes."""
        job = call.job
        sink = call.sink
        rid = spec.seq_id
        ch = self._chans[rid] = _Channel()
        try:
            self._op(self._add, spec)
        except ValueError:
            self._chans.pop(rid, None)
            call.failed("engine_rejected")
            return
        self._kick()
        fmt = Formatter(job.route, rid, job.model, job.include_usage)
        texts: list[str] = []
        finished = False
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not ch.tokens and ch.finish is None:
                    ch.waiter = loop.create_future()
                    await ch.waiter
                    ch.waiter = None
                if ch.error is not None:
                    finished = True
                    self._chans.pop(rid, None)
                    call.failed("engine_rejected")
                    return
                toks = ch.tokens
                if toks:
                    ch.tokens = []
                    if not call.first_token():
                        return
                    if job.stream:
                        if not sink.started:
                            await sink.start(200, SSE_HEADERS)
                            out = fmt.opening() + b"".join([fmt.token(t) for t in toks])
                        else:
                            out = b"".join([fmt.token(t) for t in toks])
                        await sink.send(out)
                    else:
                        texts.extend(toks)
                fin = ch.finish
                if fin is not None and not ch.tokens:
                    finished = True
                    self._chans.pop(rid, None)
                    reason = "length" if fin.reason == "length" else "stop"
                    if job.stream:
                        if not sink.started:
                            await sink.start(200, SSE_HEADERS)
                            await sink.send(fmt.opening())
                        await sink.send(
                            fmt.closing(reason, fin.prompt_tokens, fin.completion_tokens), False
                        )
                    else:
                        body = fmt.whole(
                            "".join(texts), reason, fin.prompt_tokens, fin.completion_tokens
                        )
                        await sink.start(200, JSON_HEADERS)
                        await sink.send(body, False)
                    call.done(fin.completion_tokens, fin.prompt_tokens)
                    return
        finally:
            if not finished:
                self._chans.pop(rid, None)
                self._op(self.engine.abort, rid)

    # ------------------------------------------------------------------ the step loop
    def _op(self, fn: Callable[..., None], *args: Any) -> None:
        if self._stepping:
            self._pending.append((fn, args))
        else:
            fn(*args)

    def _add(self, spec: SeqSpec) -> None:
        try:
            self.engine.add(spec)
        except ValueError as exc:
            if not self._in_pending:  # called directly: the caller reports it
                raise
            ch = self._chans.get(spec.seq_id)
            if ch is not None:
                ch.error = str(exc)
                ch.wake()

    def _kick(self) -> None:
        idle = self._idle
        if idle is not None and not idle.done():
            idle.set_result(None)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        engine = self.engine
        target = time.monotonic()
        while not self._closed:
            if not engine.has_work():
                self._idle = loop.create_future()
                await self._idle
                self._idle = None
                target = time.monotonic()  # an idle engine starts its next step on arrival
                continue
            if self.modelled_time:
                res = engine.step()
                if res.duration_s <= 0:  # nothing schedulable until something changes
                    self._deliver(res)
                    self._idle = loop.create_future()
                    await self._idle
                    self._idle = None
                    target = time.monotonic()
                    continue
                now = time.monotonic()
                start = target if now - target < _CATCH_UP_S else now
                target = start + res.duration_s * self.time_scale
                delay = target - time.monotonic()
                # always yield, so that a step loop behind schedule cannot starve the I/O
                await asyncio.sleep(delay if delay > 0 else 0)
            else:
                self._stepping = True
                try:
                    res = await asyncio.to_thread(engine.step)
                finally:
                    self._stepping = False
                    pending, self._pending = self._pending, []
                    self._in_pending = True
                    try:
                        for fn, args in pending:
                            fn(*args)
                    finally:
                        self._in_pending = False
            self.steps += 1
            self._deliver(res)

    def _deliver(self, res: StepResult) -> None:
        chans = self._chans
        for tok in res.tokens:
            ch = chans.get(tok.seq_id)
            if ch is not None:
                ch.tokens.append(tok.text)
                ch.wake()
        for fin in res.finished:
            ch = chans.get(fin.seq_id)
            if ch is not None:
                ch.finish = fin
                ch.wake()
