"""A 50,000-line batch file through a gateway (in this process: uvicorn with uvloop and the
gateway's own HTTP protocol, the simulated engine), and what it costs the event loop.

A probe task on the gateway's loop sleeps 1 ms at a time and records how late it wakes (the
loop's stall). Phases, one run: the loop idle (the baseline), ``files.create`` of the file
with the ``openai`` client (its time, MB/s, the gateway's RSS growth), the job's validation
(``BatchStore.validate``: the file read into 50,000 lines), and every line's answer recorded in
groups as a feeder would (``BatchStore.record``: SQLite writes/s), then ``finish`` (the output
file written). Worst and p99 stall per phase, and the worst against the idle baseline's.

    PYTHONPATH=src .venv/bin/python bench/batches_upload.py [--lines 50000] [--group 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import tempfile
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import uvicorn
import uvloop
from openai import OpenAI

from qosgate.config import default_config
from qosgate.runtime.batches.records import LineResult
from qosgate.server.compose import build_gateway
from qosgate.server.protocol import ConnectionStats, guarded_protocol
from qosgate.server.run import connection_limits
from qosgate.settings import settings_from_mapping

T = TypeVar("T")
MODEL = "qosgate-sim"
TICK_S = 0.001


class Probe:
    """How late a 1 ms sleep wakes on the loop, sample by sample, by phase."""

    def __init__(self) -> None:
        self.phase = "start"
        self.lags: dict[str, list[float]] = {}

    async def run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(TICK_S)
            self.lags.setdefault(self.phase, []).append(time.perf_counter() - t0 - TICK_S)


def rss_mb() -> float:
    """The process's resident set now (Linux /proc), in MB."""
    for row in Path("/proc/self/status").read_text().splitlines():
        if row.startswith("VmRSS:"):
            return int(row.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_file(path: Path, n: int) -> int:
    """``n`` chat lines of a few hundred bytes each (a summary task over varied text)."""
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({
                "custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": MODEL, "max_tokens": 64, "messages": [
                    {"role": "system", "content": "Summarise the document in one sentence."},
                    {"role": "user", "content": f"Document {i}: " + "lorem ipsum " * 20}]},
            }) + "\n")
    return path.stat().st_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=50_000)
    ap.add_argument("--group", type=int, default=32, help="answers recorded per transaction")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="qosgate-batch-bench-"))
    settings = settings_from_mapping({"engine": {"kind": "sim"},
                                      # the bench plays the feeder's part itself
                                      "batches": {"dir": str(tmp / "state"), "feed": False}})
    gw = build_gateway(default_config(), settings)
    store = gw.batch_store
    assert store is not None
    config = uvicorn.Config(gw, host="127.0.0.1", port=0, loop="uvloop", lifespan="on",
                            http=guarded_protocol(connection_limits(settings),
                                                  ConnectionStats()),
                            access_log=False, log_level="warning")
    server = uvicorn.Server(config)
    probe = Probe()
    loop_box: list[asyncio.AbstractEventLoop] = []

    async def serve() -> None:
        loop_box.append(asyncio.get_running_loop())
        task = asyncio.create_task(probe.run())
        await server.serve()
        task.cancel()

    thread = threading.Thread(target=lambda: uvloop.run(serve()), daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    loop = loop_box[0]
    port = server.servers[0].sockets[0].getsockname()[1]

    def on_loop(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    path = tmp / "in.jsonl"
    size = write_file(path, args.lines)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    rows: list[tuple[str, str, str]] = []

    probe.phase = "idle"
    time.sleep(2.0)

    probe.phase = "upload"
    rss0 = rss_mb()
    t0 = time.perf_counter()
    with path.open("rb") as f:
        fobj = client.files.create(file=f, purpose="batch")
    up_s = time.perf_counter() - t0
    rss1 = rss_mb()
    rows.append(("upload", f"{up_s:.2f} s", f"{size / 1e6:.1f} MB, {size / 1e6 / up_s:.0f} MB/s, "
                 f"RSS +{rss1 - rss0:.1f} MB"))

    job = client.batches.create(input_file_id=fobj.id, endpoint="/v1/chat/completions",
                                completion_window="24h")
    probe.phase = "validate"
    t0 = time.perf_counter()
    rec = on_loop(store.validate(job.id, lambda m: m == MODEL, 0))
    val_s = time.perf_counter() - t0
    assert rec.status == "in_progress" and rec.total == args.lines, rec
    rows.append(("validate", f"{val_s:.2f} s", f"{args.lines / val_s:,.0f} lines/s"))

    probe.phase = "record"
    answer = json.dumps({"choices": [{"message": {"content": "A summary."}}]}).encode()
    t0 = time.perf_counter()

    async def record_all() -> int:
        written = 0
        while True:
            tasks = await store.next_lines(job.id, args.group, ())
            if not tasks:
                return written
            written += await store.record(0, [LineResult(job.id, t.line, f"r{t.line}", 200,
                                                         answer) for t in tasks])

    n = on_loop(record_all())
    rec_s = time.perf_counter() - t0
    rows.append(("record", f"{rec_s:.2f} s", f"{n / rec_s:,.0f} answers/s in "
                 f"{n // args.group} transactions of {args.group} "
                 f"(next_lines read between them)"))

    probe.phase = "finish"
    t0 = time.perf_counter()
    done = on_loop(store.finish(job.id, 0, "completed"))
    fin_s = time.perf_counter() - t0
    rows.append(("finish", f"{fin_s:.2f} s", f"output file {done.output_file_id}"))
    probe.phase = "end"
    # the client runs in this process too: its share of the GIL is in the stalls (an upper
    # bound of what a gateway of its own would see)
    server.should_exit = True
    thread.join(10)

    print(f"batch file: {args.lines} lines, {size / 1e6:.1f} MB; gateway in this process "
          "(uvloop, the gateway's HTTP protocol, sim engine)")
    print(f"{'phase':<10} {'time':>8}  what")
    for name, took, what in rows:
        print(f"{name:<10} {took:>8}  {what}")
    print()
    base = max(probe.lags.get("idle", [0.0]))
    print(f"{'loop stall':<10} {'samples':>8} {'p99 ms':>8} {'worst ms':>9} {'worst/idle':>11}")
    for name in ("idle", "upload", "validate", "record", "finish"):
        lags = sorted(probe.lags.get(name, []))
        if not lags:
            continue
        p99 = lags[min(len(lags) - 1, int(len(lags) * 0.99))]
        print(f"{name:<10} {len(lags):>8} {p99 * 1e3:>8.2f} {lags[-1] * 1e3:>9.2f} "
              f"{lags[-1] / base if base > 0 else float('nan'):>11.1f}")


if __name__ == "__main__":
    main()
