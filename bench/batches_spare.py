"""Batch jobs on spare capacity, through real processes: 2 vLLM stand-ins behind the gateway.

    .venv/bin/python bench/batches_spare.py [--quick] [--seed 1] [--live-rate 4] [--time-scale 4]

A benchmark, not a test: it prints what happened, in one run.

(a) **Beside live traffic.** Five phases, each on a fresh gateway (a fresh batches directory)
in front of the same stand-ins, each ``--window`` seconds after a warm-up:

1. *live*: a steady open-loop Poisson stream (seeded, the same in every phase), half realtime
   and half api, all streaming;
2. *live + job*: the same stream and a 5,000-line job (``POST /v1/files`` + ``/v1/batches``,
   the default class ``batch``);
3. *live + loop*: the same stream and a saturating client loop of batch-class requests (as
   many open at once as the replicas' windows hold, plus ``queued_per_job``), the job's own
   request each;
4. *job*: the job alone; 5. *loop*: the loop alone.

The job (or the loop) starts after the gateway has watched its live traffic for two
``batches.live_span_s`` (set to ``LIVE_SPAN_S`` here), as a gateway that has been running a
while has; TTFTs count the live requests sent in the measured window.

Printed: realtime and api TTFT p50/p99 (client side, to the first SSE event) per phase, and
the ratio with/without the job (goal <= 1.1); the job's output tokens/s (its lines answered in
the window x their max_tokens: the stand-in generates exactly that many) against the loop's
(requests completed in the window x the same max_tokens) beside live traffic (goal >= 0.9) and
alone (goal >= 0.95).

The stand-ins schedule by priority (vLLM's ``--scheduling-policy priority``), and the gateway
forwards each request's class as its priority, as a deployment beside live traffic would.

(b) **A 50,000-line file** (fresh gateway and stand-ins at ``--time-scale 0.01``: the engine is
not what limits the job; max_tokens 1): the upload's time
(``files.create``), the gateway's RSS (``/proc/<pid>/status`` VmRSS) before the upload and its
peak while the job runs (goal: growth < 100 MB), lines recorded per second in SQLite while the
job runs (``request_counts``), and the worst wait of ``GET /healthz`` sent every 20 ms meanwhile
(the event loop's worst stall, as a client sees it: a blocked loop answers nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the one server-process wrapper lives with the tests

from openai import OpenAI  # noqa: E402

from bench.fleet_faults import Rec, one, pct  # noqa: E402
from qosgate.settings import BatchSettings  # noqa: E402
from tests.support.httpclient import http  # noqa: E402
from tests.support.processes import MODEL, Server, start_gateway, start_standin  # noqa: E402

REPLICAS = 2
CAPACITY = 16  # each upstream's window at most (and the stand-ins' batch)
QUEUED_PER_JOB = BatchSettings().queued_per_job  # the default, as a deployment runs it
JOB_TOKENS = 64  # max_tokens of a job's line (and of the loop's requests)
# batches.live_span_s: shorter than the default 30 s so that each phase's gateway has
# watched its live traffic for a whole window (it waits this long first) in a short bench
LIVE_SPAN_S = 10.0
JOB_PROMPT_CHARS = 400
LIVE = (("realtime", 24, 200), ("api", 64, 800))  # class, max_tokens, prompt characters


@dataclass
class Phase:
    name: str
    live: list[Rec] = field(default_factory=list)
    job_tokens_s: float | None = None
    loop_tokens_s: float | None = None


def gateway(tmp: Path, urls: list[str], name: str, headroom: float | None = None) -> Server:
    cfg: dict[str, Any] = {
        "upstreams": [{"url": u, "name": f"r{i}", "max_window": CAPACITY,
                       "priority_polarity": "vllm"} for i, u in enumerate(urls)],
        "batches": {"dir": str(tmp / f"batches-{name}"), "live_span_s": LIVE_SPAN_S},
    }
    if headroom is not None:
        cfg["batches"]["headroom"] = headroom
    path = tmp / f"gateway-{name}.json"
    path.write_text(json.dumps(cfg))
    return start_gateway(tmp, "--config", str(path))


def job_file(path: Path, n: int, max_tokens: int, prompt_chars: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({
                "custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                "body": {"model": MODEL, "max_tokens": max_tokens, "messages": [
                    {"role": "user", "content": f"bench-{i} " + "y" * prompt_chars}]},
            }) + "\n")
    return path


def submit(gw: Server, path: Path) -> tuple[OpenAI, str, float]:
    """Upload and create: the client, the job's id and the upload's seconds."""
    c = OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=600)
    t0 = time.monotonic()
    with path.open("rb") as f:
        fid = c.files.create(file=f, purpose="batch").id
    upload_s = time.monotonic() - t0
    return c, c.batches.create(input_file_id=fid, endpoint="/v1/chat/completions",
                               completion_window="24h").id, upload_s


def answered(c: OpenAI, batch_id: str) -> int:
    rc = c.batches.retrieve(batch_id).request_counts
    return 0 if rc is None else rc.completed + rc.failed


async def live_stream(gw: Server, rate: float, seconds: float, seed: int,
                      out: list[Rec]) -> None:
    """Open-loop Poisson arrivals, half realtime, half api; every request awaited."""
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    tasks = []
    t0 = time.monotonic()
    at = 0.0
    i = 0
    while True:
        at += rng.expovariate(rate)
        if at >= seconds:
            break
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        cls, tokens, chars = LIVE[i % 2]
        rec = Rec(i, cls, tokens, chars)
        i += 1
        out.append(rec)
        tasks.append(loop.create_task(one(gw.port, rec)))
    await asyncio.gather(*tasks)


async def client_loop(gw: Server, width: int, stop: asyncio.Event, done: list[float]) -> None:
    """``width`` batch-class requests open at all times until ``stop``; each completion's
    time in ``done``."""
    counter = iter(range(10**9))

    async def worker() -> None:
        while not stop.is_set():
            rec = Rec(-next(counter) - 1, "batch", JOB_TOKENS, JOB_PROMPT_CHARS)
            await one(gw.port, rec)
            if rec.outcome == "completed":
                done.append(time.monotonic())

    await asyncio.gather(*(worker() for _ in range(width)))


async def phase(name: str, tmp: Path, urls: list[str], args: argparse.Namespace,
                job: Path | None, loop_width: int) -> Phase:
    """One phase on a fresh gateway: live traffic (if any) from the start; the job or the loop
    after two ``LIVE_SPAN_S`` (a gateway that has run a while has watched its steady live
    traffic, past its own start-up); measured over ``args.window`` after a further
    ``args.warm``."""
    ph = Phase(name)
    gw = gateway(tmp, urls, name, args.headroom)
    try:
        c = bid = None
        stop = asyncio.Event()
        done: list[float] = []
        lead = 2 * LIVE_SPAN_S + args.warm
        live = (asyncio.create_task(live_stream(gw, args.live_rate, lead + args.window,
                                                args.seed, ph.live))
                if name.startswith("live") else None)
        await asyncio.sleep(2 * LIVE_SPAN_S)
        if job is not None:
            c, bid, _ = await asyncio.to_thread(submit, gw, job)
        looping = (asyncio.create_task(client_loop(gw, loop_width, stop, done))
                   if loop_width else None)
        await asyncio.sleep(args.warm)
        t0 = time.monotonic()
        a = await asyncio.to_thread(answered, c, bid) if c and bid else 0
        await asyncio.sleep(args.window)
        t1 = time.monotonic()
        if c is not None and bid is not None:
            b = await asyncio.to_thread(answered, c, bid)
            ph.job_tokens_s = (b - a) * JOB_TOKENS / (t1 - t0)
        if looping is not None:
            ph.loop_tokens_s = sum(1 for t in done if t0 <= t < t1) * JOB_TOKENS / (t1 - t0)
        if live is not None:
            await live
            ph.live = [r for r in ph.live if t0 <= r.sent < t1]  # the measured window's
        stop.set()
        if looping is not None:
            looping.cancel()
            await asyncio.gather(looping, return_exceptions=True)
    finally:
        gw.stop_timeout = 5.0
        gw.stop()
    return ph


def ttft(recs: list[Rec], cls: str, q: float) -> float | None:
    xs = [r.first - r.sent for r in recs if r.cls == cls and r.first is not None]
    return pct(xs, q)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:8.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or b == 0 else f"{a / b:6.2f}"


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def big_file(tmp: Path, urls: list[str], n: int) -> dict[str, Any]:
    """(b): a file of ``n`` lines, uploaded and run with max_tokens 1."""
    path = job_file(tmp / "big.jsonl", n, 1, 100)
    gw = gateway(tmp, urls, "big")
    try:
        rss0 = rss_kb(gw.proc.pid)
        c, bid, upload_s = await asyncio.to_thread(submit, gw, path)
        peak = rss_kb(gw.proc.pid)
        worst = 0.0
        samples: list[tuple[float, int]] = []
        t_end = time.monotonic() + 600
        while time.monotonic() < t_end:
            t = time.monotonic()
            await asyncio.to_thread(http, "GET", gw.url + "/healthz")
            worst = max(worst, time.monotonic() - t)
            peak = max(peak, rss_kb(gw.proc.pid))
            if len(samples) % 25 == 0:
                rec = await asyncio.to_thread(c.batches.retrieve, bid)
                rc = rec.request_counts
                samples.append((time.monotonic(), 0 if rc is None else rc.completed + rc.failed))
                if rec.status in ("completed", "failed", "expired", "cancelled"):
                    break
            else:
                samples.append(samples[-1] if samples else (time.monotonic(), 0))
            await asyncio.sleep(0.02)
        counted = [s for s in samples if s[1] > 0]
        writes_s = ((counted[-1][1] - counted[0][1]) / (counted[-1][0] - counted[0][0])
                    if len(counted) > 1 and counted[-1][0] > counted[0][0] else None)
        return {"lines": n, "bytes": path.stat().st_size, "upload_s": upload_s,
                "rss0_mb": rss0 / 1024, "peak_mb": peak / 1024, "writes_s": writes_s,
                "worst_stall_ms": worst * 1000, "status": rec.status}
    finally:
        gw.stop_timeout = 5.0
        gw.stop()


async def run(args: argparse.Namespace, tmp: Path) -> None:
    sis = [start_standin(tmp, "--time-scale", str(args.time_scale), "--max-num-seqs",
                         str(CAPACITY), "--scheduling-policy", "priority")
           for _ in range(REPLICAS)]
    urls = [s.url for s in sis]
    width = REPLICAS * CAPACITY + QUEUED_PER_JOB
    job = job_file(tmp / "job.jsonl", args.lines, JOB_TOKENS, JOB_PROMPT_CHARS)
    try:
        phases = [
            await phase("live", tmp, urls, args, None, 0),
            await phase("live+job", tmp, urls, args, job, 0),
            await phase("live+loop", tmp, urls, args, None, width),
            await phase("job", tmp, urls, args, job, 0),
            await phase("loop", tmp, urls, args, None, width),
        ]
    finally:
        for s in sis:
            s.stop()
    # (b) on engines 100x faster than the profile's: what limits the job is then the gateway
    sis = [start_standin(tmp, "--time-scale", "0.01", "--max-num-seqs", str(CAPACITY))
           for _ in range(REPLICAS)]
    try:
        big = await big_file(tmp, [s.url for s in sis], args.big_lines)
    finally:
        for s in sis:
            s.stop()
    headroom = BatchSettings().headroom if args.headroom is None else args.headroom
    print(f"\n(a) {args.lines}-line job (max_tokens {JOB_TOKENS}) beside live traffic "
          f"({args.live_rate:g} req/s, realtime/api), {REPLICAS} stand-ins x {CAPACITY}, "
          f"--time-scale {args.time_scale:g}, window {args.window:g} s after {args.warm:g} s, "
          f"batches.headroom {headroom:g}")
    print(f"{'phase':<10} {'rt p50':>8} {'rt p99':>8} {'api p50':>8} {'api p99':>8} "
          f"{'live n':>6} {'job tok/s':>10} {'loop tok/s':>10}")
    for ph in phases:
        n = sum(1 for r in ph.live if r.outcome == "completed")
        print(f"{ph.name:<10} {_ms(ttft(ph.live, 'realtime', 50))} "
              f"{_ms(ttft(ph.live, 'realtime', 99))} {_ms(ttft(ph.live, 'api', 50))} "
              f"{_ms(ttft(ph.live, 'api', 99))} {n:>6} "
              f"{'-' if ph.job_tokens_s is None else f'{ph.job_tokens_s:10.0f}'} "
              f"{'-' if ph.loop_tokens_s is None else f'{ph.loop_tokens_s:10.0f}'}")
    live, with_job, with_loop, job_alone, loop_alone = phases
    print("ratios:")
    for cls in ("realtime", "api"):
        print(f"  {cls} TTFT p99 with the job / without: "
              f"{_ratio(ttft(with_job.live, cls, 99), ttft(live.live, cls, 99))}  (goal <= 1.1)")
    print(f"  job tok/s / loop tok/s beside live traffic: "
          f"{_ratio(with_job.job_tokens_s, with_loop.loop_tokens_s)}  (goal >= 0.9)")
    print(f"  job tok/s / loop tok/s alone: "
          f"{_ratio(job_alone.job_tokens_s, loop_alone.loop_tokens_s)}  (goal >= 0.95)")
    print(f"\n(b) {big['lines']}-line file ({big['bytes'] / 1e6:.1f} MB), max_tokens 1, "
          "stand-ins --time-scale 0.01: "
          f"ended {big['status']}")
    print(f"  upload {big['upload_s']:.2f} s; gateway RSS {big['rss0_mb']:.0f} MB before, "
          f"peak {big['peak_mb']:.0f} MB (growth {big['peak_mb'] - big['rss0_mb']:.0f} MB, "
          f"goal < 100)")
    ws = big["writes_s"]
    print(f"  lines recorded/s: {'-' if ws is None else f'{ws:.0f}'}; worst /healthz wait "
          f"meanwhile: {big['worst_stall_ms']:.0f} ms")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="shorter windows, smaller files")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--live-rate", type=float, default=4.0, help="live requests/s")
    p.add_argument("--headroom", type=float, default=None,
                   help="batches.headroom (default: the setting's default)")
    p.add_argument("--time-scale", type=float, default=4.0,
                   help="the stand-ins' step time multiplier (a fleet a 2-core box saturates)")
    args = p.parse_args(argv)
    args.warm, args.window = (3.0, 10.0) if args.quick else (5.0, 30.0)
    args.lines = 5000
    args.big_lines = 5000 if args.quick else 50_000
    with tempfile.TemporaryDirectory(prefix="batch-jobs-") as d:
        asyncio.run(run(args, Path(d)))


if __name__ == "__main__":
    main()
