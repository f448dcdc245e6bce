"""Under saturation, realtime requests' TTFT p99 stays below batch requests' TTFT p50.

Wide margin by construction: a 2-request window in front of the stand-in, 30 batch requests
queued at once, then realtime requests arriving one by one. A realtime request waits at most
for one slot to free (~one short request); the median batch request waits for about half the
backlog (~7 short requests)."""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from tests.support.processes import MODEL, Server, start_gateway

pytestmark = pytest.mark.e2e

CONFIG = """
classes:
  - {name: realtime, level: 0, strict: true, ttft_budget_ms: 1000, queue_timeout_s: 30,
     max_queue: 1000, can_preempt: true}
  - {name: api, level: 1, weight: 5, ttft_budget_ms: 5000, queue_timeout_s: 60, max_queue: 1000}
  - {name: batch, level: 2, weight: 3, ttft_budget_ms: 30000, queue_timeout_s: 60,
     max_queue: 1000, preemptible: true}
  - {name: offline, level: 3, weight: 2, ttft_budget_ms: 300000, queue_timeout_s: 60,
     max_queue: 1000, preemptible: true}
"""


async def _ttft(c: AsyncOpenAI, cls: str, delay: float) -> float:
    await asyncio.sleep(delay)
    t0 = time.monotonic()
    stream = await c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "go"}], max_tokens=16, stream=True,
        extra_headers={"x-qos-class": cls},
    )
    first: float | None = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic() - t0
    assert first is not None
    return first


def test_realtime_p99_below_batch_p50(standin: Server, tmp_session: Path) -> None:
    cfg = tmp_session / "saturation.yaml"
    cfg.write_text(CONFIG)
    gw = start_gateway(tmp_session, "--config", str(cfg), "--upstream", standin.url,
                       "--upstream-capacity", "2", "--upstream-polarity", "vllm")
    try:
        async def run() -> tuple[list[float], list[float]]:
            c = AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=60)
            batch = [asyncio.create_task(_ttft(c, "batch", 0.0)) for _ in range(30)]
            rt = [asyncio.create_task(_ttft(c, "realtime", 0.4 + 0.15 * i)) for i in range(10)]
            return list(await asyncio.gather(*rt)), list(await asyncio.gather(*batch))

        realtime, batch = asyncio.run(run())
    finally:
        gw.stop()
    rt_p99 = sorted(realtime)[-1]  # 10 samples: p99 is the max
    batch_p50 = statistics.median(batch)
    print(f"realtime TTFT p99 {rt_p99:.3f}s, batch TTFT p50 {batch_p50:.3f}s")
    assert rt_p99 < batch_p50, (sorted(realtime), sorted(batch))
