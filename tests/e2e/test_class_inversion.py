"""Tag only the batch job: untagged requests (class api) beside a tagged offline flood are all
served, each ahead of every offline request that arrived after it.

The gateway runs on its defaults in front of the stand-in (realtime's reserved share, the
adaptive window, the prefill budget as shipped); the flood keeps a backlog of offline requests
queued in the gateway throughout. The order is read where it counts, at the engine: the
stand-in records every request body as it arrives there. An offline request sent after an api
request stands behind the whole offline backlog, so it reaches the engine first only if api
waits out that backlog: the inversion this pins (the reserve, lent only to offline, once
starved api behind offline and then refused it as overloaded).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from tests.support.classes import admitted_on_queue_time
from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import MODEL, start_gateway, start_standin
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

# offline streams, closed loop: more than the engine's batch of 16 takes, so a backlog of
# offline requests stands in the gateway (its window holds the engine's batch and a little more)
FLOOD = 32
API = 20  # untagged requests, two a second while the offline backlog stands
REALTIME = 10  # and tagged realtime ones, one a second, beside them


def test_untagged_requests_beside_a_tagged_offline_flood_go_ahead_of_later_offline(
    tmp_path: Path,
) -> None:
    record = tmp_path / "engine-arrivals.jsonl"
    # a batch of 16 (the window is 10 or more, so realtime's reserve of 10% holds a slot), at
    # an eighth of the modelled speed: offline streams hold their slots for seconds
    si = start_standin(tmp_path, "--scheduling-policy", "priority", "--max-num-seqs", "16",
                       "--time-scale", "8", "--record", str(record))
    # admitted on queue time: the test is of the order the engine runs what it was sent (on a
    # loaded CI box, deadline admission may refuse an api request the flood delays)
    cfg = tmp_path / "queue-time.json"
    cfg.write_text(json.dumps({"classes": [c.model_dump(mode="json")
                                           for c in admitted_on_queue_time()]}))
    gw = start_gateway(tmp_path, "--config", str(cfg), "--upstream", si.url)
    seq = itertools.count()
    sent: dict[str, tuple[int, str]] = {}  # marker -> (send order, class)
    api_out: list[tuple[str, str]] = []  # (marker, finish_reason)

    def offline_queued() -> bool:
        _, _, body = http("GET", gw.url + "/metrics")
        depth = metric_values(body.decode(), "qosgate_queue_depth")
        return depth.get((("class", "offline"),), 0.0) >= 8

    async def one(c: AsyncOpenAI, cls: str | None, max_tokens: int) -> str | None:
        marker = f"inv-{next(seq)}"
        sent[marker] = (int(marker[4:]), cls or "api")  # (cls None: untagged)
        stream = await c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"{marker} go"}],
            max_tokens=max_tokens, stream=True,
            extra_headers={"x-qos-class": cls} if cls else None,
        )
        finish = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        if cls is None:
            api_out.append((marker, finish or ""))
        return finish

    async def run() -> None:
        c = AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)
        stop = asyncio.Event()

        async def flood() -> None:
            while not stop.is_set():
                await one(c, "offline", 160)

        async def paced(cls: str | None, n: int, every: float, max_tokens: int) -> None:
            tasks = []
            for _ in range(n):
                tasks.append(asyncio.create_task(one(c, cls, max_tokens)))
                await asyncio.sleep(every)  # the pace of arrivals, not a wait for an outcome
            await asyncio.gather(*tasks)

        floods = [asyncio.create_task(flood()) for _ in range(FLOOD)]
        loop = asyncio.get_running_loop()
        assert await loop.run_in_executor(None, lambda: wait_until(offline_queued, 60))
        await asyncio.gather(paced(None, API, 0.5, 8), paced("realtime", REALTIME, 1.0, 16))
        stop.set()
        await asyncio.gather(*floods)

    try:
        asyncio.run(run())
        _, _, body = http("GET", gw.url + "/metrics")
    finally:
        gw.stop()
        si.stop()
    assert len(api_out) == API and all(f == "length" for _, f in api_out), api_out
    served = metric_values(body.decode(), "qosgate_requests_total")
    api_done = sum(v for k, v in served.items()
                   if ("class", "api") in k and ("outcome", "completed") in k)
    assert api_done == API  # untagged is api, and every one of them completed

    arrived: list[str] = []  # markers in the order the engine received them
    for line in record.read_text().splitlines():
        rec = json.loads(line)
        if rec["path"] != "/v1/chat/completions":
            continue  # an evicted offline stream's continuation (token ids): not an arrival
        content = json.loads(base64.b64decode(rec["body"]))["messages"][0]["content"]
        arrived.append(content.split()[0])
    at = {m: i for i, m in enumerate(arrived)}
    for marker, _ in api_out:
        order = sent[marker][0]
        later_offline_first = [m for m, (o, cls) in sent.items()
                               if cls == "offline" and o > order and m in at
                               and at[m] < at[marker]]
        assert not later_offline_first, (marker, later_offline_first)
