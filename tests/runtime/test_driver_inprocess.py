"""The asyncio driver with an in-process engine, no HTTP: pause/resume at a token boundary."""

from __future__ import annotations

import asyncio

from qosgate.config import default_config
from qosgate.core import QosInputs, ReplicaSpec, Scheduler, State
from qosgate.models.simmodel import EngineProfile, SimEngine
from qosgate.runtime.driver import Driver, Ticket
from qosgate.runtime.inprocess import InProcessEngine
from qosgate.wire.engine_request import EngineRequest

FAST = EngineProfile(
    name="fast", model="m", gpu="none", step_fixed_s=0.002, prefill_s_per_token=0.0,
    decode_s_per_ctx_token=0.0, decode_s_per_seq=0.0, max_num_seqs=8,
    max_num_batched_tokens=4096, kv_capacity_tokens=100_000,
)


class Sink:
    def __init__(self) -> None:
        self.started = False
        self.complete = False
        self.data = b""
        self.status = 0

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status

    async def send(self, data: bytes, more: bool = True) -> None:
        self.data += data
        self.complete = not more


def test_realtime_pauses_batch_and_batch_resumes_without_loss() -> None:
    async def run() -> tuple[Ticket, Ticket, int]:
        eng = InProcessEngine(SimEngine(FAST, "priority"), name="sim", max_window=1, models=["m"])
        sched = Scheduler(default_config(), None, [ReplicaSpec("sim", 1, pausable=True)])
        drv = Driver(sched, {"sim": eng})
        await drv.start()

        def ticket(rid: str, cls: str, n: int) -> Ticket:
            req = sched.make_request(rid, QosInputs(qos_class=cls), drv.clock(), 10, n)
            engine_request = EngineRequest(rid=rid, route="completions", body=b"{}", stream=True,
                                           model="m", max_tokens=n, prompt_tokens=10)
            return drv.ticket(req, engine_request, Sink())

        batch = ticket("b", "batch", 60)
        drv.submit(batch)
        while batch.req.state is not State.RUNNING:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.02)
        rt = ticket("r", "realtime", 5)
        drv.submit(rt)
        assert batch.req.state is State.QUEUED  # paused, its slot given to realtime
        await rt.finished
        await batch.finished
        await drv.close()
        return batch, rt, batch.req.preemptions

    batch, rt, preemptions = asyncio.run(run())
    assert rt.req.state is State.COMPLETED and batch.req.state is State.COMPLETED
    assert preemptions == 1
    assert isinstance(batch.client, Sink)
    # every token exactly once: 60 token chunks, then the finish chunk and [DONE]
    assert batch.client.data.count(b'"finish_reason":null') == 60
    assert batch.client.data.endswith(b"data: [DONE]\n\n")
    assert batch.req.output_tokens == 60
    assert rt.req.finished_at is not None and batch.req.finished_at is not None
    assert rt.req.finished_at < batch.req.finished_at
