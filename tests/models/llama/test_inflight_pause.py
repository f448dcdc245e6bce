"""A pause that lands while the step is in flight, on the driver + llama.cpp (no HTTP).

llama.cpp steps in a worker thread; a pause decided meanwhile applies at the next token boundary,
so the step in flight may still produce a token -- or the last token -- for the paused request.
The in-process engine holds that token (or the finish) back until the scheduler resumes the
request: nothing reaches the client of a queued request, nothing is lost, and the sequence is not
aborted and restarted. ``Gated`` makes the race deterministic: just before a chosen step it runs
the realtime submission on the event loop and waits for it, so the pause arrives mid-step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Coroutine
from typing import Any

from qosgate.config import default_config
from qosgate.core import QosInputs, ReplicaSpec, Scheduler, State
from qosgate.models.llamacpp import LlamaCppEngine
from qosgate.models.step import SeqSpec, StepResult
from qosgate.runtime.driver import Driver, Ticket
from qosgate.runtime.inprocess import InProcessEngine
from qosgate.wire.engine_request import EngineRequest
from tests.support.llama import MODEL, MODEL_PATH

PROMPT = "Write a long story about a lighthouse keeper and a storm."
N = 12


class Sink:
    def __init__(self) -> None:
        self.started = False
        self.complete = False
        self.status = 0
        self.data = b""

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status

    async def send(self, data: bytes, more: bool = True) -> None:
        self.data += data
        self.complete = not more

    def contents(self) -> list[str]:
        out = []
        for line in self.data.split(b"\n\n"):
            if line.startswith(b"data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content") is not None:
                    out.append(delta["content"])
        return out


class Gated:
    """A LlamaCppEngine whose ``step`` first runs ``action`` on the loop when ``when`` holds."""

    def __init__(self, inner: LlamaCppEngine, loop: asyncio.AbstractEventLoop) -> None:
        self.inner = inner
        self.loop = loop
        self.max_num_seqs = inner.max_num_seqs
        self.ordered = inner.ordered
        self.when: Callable[[LlamaCppEngine], bool] | None = None
        self.action: Callable[[], Coroutine[Any, Any, None]] | None = None
        self.adds: list[str] = []

    def add(self, spec: SeqSpec) -> None:
        self.adds.append(spec.seq_id)
        self.inner.add(spec)

    def pause(self, seq_id: str) -> None:
        self.inner.pause(seq_id)

    def resume(self, seq_id: str) -> None:
        self.inner.resume(seq_id)

    def abort(self, seq_id: str) -> None:
        self.inner.abort(seq_id)

    def has_work(self) -> bool:
        return self.inner.has_work()

    def step(self) -> StepResult:  # runs in the worker thread
        if self.when is not None and self.action is not None and self.when(self.inner):
            self.when = None
            asyncio.run_coroutine_threadsafe(self.action(), self.loop).result(30)
        return self.inner.step()


def run_case(when: Callable[[LlamaCppEngine], bool] | None) -> tuple[Ticket, Ticket | None, Gated]:
    async def main() -> tuple[Ticket, Ticket | None, Gated]:
        llama = LlamaCppEngine(MODEL_PATH, max_num_seqs=2, n_ctx_per_seq=256, n_threads=2)
        gated = Gated(llama, asyncio.get_running_loop())
        eng = InProcessEngine(gated, name="llama", max_window=1, models=[MODEL],
                              modelled_time=False, text=True)
        sched = Scheduler(default_config(), None, [ReplicaSpec("llama", 1, pausable=True)])
        drv = Driver(sched, {"llama": eng})
        await drv.start()

        def ticket(rid: str, cls: str, content: str, n: int) -> Ticket:
            body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                               "max_tokens": n, "stream": True, "temperature": 0}).encode()
            req = sched.make_request(rid, QosInputs(qos_class=cls), drv.clock(), 10, n)
            engine_request = EngineRequest(rid=rid, route="chat", body=body, stream=True,
                                           model=MODEL, max_tokens=n, prompt_tokens=10)
            return drv.ticket(req, engine_request, Sink())

        victim = ticket("v", "offline", PROMPT, N)
        rt: list[Ticket] = []

        async def submit_realtime() -> None:
            t = ticket("r", "realtime", "Say hello.", 4)
            drv.submit(t)
            assert victim.req.state is State.QUEUED  # paused: its window slot went to "r"
            rt.append(t)

        gated.when, gated.action = when, submit_realtime
        drv.submit(victim)
        await asyncio.wait_for(victim.finished, 120)
        if rt:
            await asyncio.wait_for(rt[0].finished, 120)
        await drv.close()
        return victim, (rt[0] if rt else None), gated

    return asyncio.run(main())


def check_against_alone(victim: Ticket, rt: Ticket | None, gated: Gated, alone: Ticket) -> None:
    assert rt is not None
    assert victim.req.state is State.COMPLETED and rt.req.state is State.COMPLETED
    assert victim.req.preemptions == 1
    assert gated.adds == ["v", "r"]  # paused, not aborted and added again
    assert isinstance(victim.client, Sink) and isinstance(alone.client, Sink)
    assert victim.client.contents() == alone.client.contents()  # each token once, in order
    assert victim.client.data.count(b"data: [DONE]") == 1
    assert victim.req.output_tokens == alone.req.output_tokens == N


def test_first_token_in_flight_when_paused_is_held_not_restarted() -> None:
    alone, _, _ = run_case(None)

    def prefill_step(e: LlamaCppEngine) -> bool:  # this step prefills "v" and samples token 0
        return "v" in e._seqs and e._seqs["v"].n_generated == 0

    victim, rt, gated = run_case(prefill_step)
    check_against_alone(victim, rt, gated, alone)
    assert rt is not None and rt.req.finished_at is not None
    # the victim's first token, computed before the pause, reached its client only after resume
    assert victim.req.first_token_at is not None
    assert victim.req.first_token_at > rt.req.finished_at


def test_last_token_in_flight_when_paused_completes_after_resume() -> None:
    alone, _, _ = run_case(None)

    def last_step(e: LlamaCppEngine) -> bool:  # this step samples the victim's last token
        return "v" in e._seqs and e._seqs["v"].n_generated == N - 1

    victim, rt, gated = run_case(last_step)
    check_against_alone(victim, rt, gated, alone)
    assert rt is not None and rt.req.finished_at is not None
    assert victim.req.finished_at is not None and victim.req.finished_at > rt.req.finished_at
