"""Gateway overhead: latency added over going straight to the engine, and max requests/s.

    .venv/bin/python bench/gateway_overhead.py [--quick]

Starts the vLLM stand-in (simulated 7B model on an H100, real-time step durations) and a gateway
in front of it (window 1024 so that it never queues: this measures the proxy path, not
scheduling), then drives both with the same aiohttp client, streaming chat requests in closed
loops of 1, 64 and 256 concurrent clients. Reported per level: TTFT (to the first streamed bytes)
and end-to-end p50/p99, direct and through the gateway, and the difference. Each client pauses a
random 0-50 ms between requests, so that arrivals do not fall into lockstep with the engine's
steps (in lockstep, one step's phase would swamp the sub-millisecond differences measured).
Then max requests/s: 256 concurrent clients, short streamed requests (4 tokens) with the stand-in
sped up x100, direct vs through the gateway.

Everything (client, gateway, stand-in) shares this machine's cores, as in the targets' setting;
on a 2-core box the gateway's CPU competes with the engine's and the client's.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass

import aiohttp
import uvloop

PY = sys.executable
QOSGATE = [PY, "-m", "qosgate.cli"]
MODEL = "Qwen/Qwen2.5-7B-Instruct"
THINK_S = 0.05  # each client pauses uniform(0, THINK_S) between requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(args: list[str], url: str, cpus: set[int] | None) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if cpus:
        os.sched_setaffinity(proc.pid, cpus)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"{args} did not start")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


@dataclass
class Run:
    ttft: list[float]
    e2e: list[float]
    wall: float
    errors: int

    @property
    def rps(self) -> float:
        return len(self.e2e) / self.wall


async def drive(url: str, conc: int, total: int, max_tokens: int, think: float) -> Run:
    body = (
        b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":"'
        + b"Tell me something interesting about queues."
        + b'"}],"stream":true,"max_tokens":' + str(max_tokens).encode() + b"}"
    )
    headers = {"Content-Type": "application/json", "Authorization": "Bearer bench"}
    ttft: list[float] = []
    e2e: list[float] = []
    errors = 0
    left = total
    rng = random.Random(conc)
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    async with aiohttp.ClientSession(connector=conn) as s:

        async def worker() -> None:
            nonlocal left, errors
            while left > 0:
                left -= 1
                t0 = time.perf_counter()
                first = None
                async with s.post(url, data=body, headers=headers) as r:
                    if r.status != 200:
                        errors += 1
                        await r.read()
                        continue
                    async for _ in r.content.iter_any():
                        if first is None:
                            first = time.perf_counter()
                t1 = time.perf_counter()
                ttft.append((first or t1) - t0)
                e2e.append(t1 - t0)
                if think:  # a random pause keeps the clients out of lockstep with the steps
                    await asyncio.sleep(rng.uniform(0, think))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(conc)))
        wall = time.perf_counter() - t0
    return Run(ttft, e2e, wall, errors)


def run(url: str, conc: int, total: int, max_tokens: int, think: float = THINK_S) -> Run:
    uvloop.run(drive(url, conc, min(conc, 16), max_tokens, think))  # warm up
    return uvloop.run(drive(url, conc, total, max_tokens, think))


def ms(x: float) -> str:
    return f"{x * 1000:8.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests per level")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-pin", action="store_true",
                    help="do not pin: client, stand-in and gateway share every core")
    args = ap.parse_args()
    ncpu = len(os.sched_getaffinity(0))
    pin = not args.no_pin and ncpu >= 2
    # pinned: the client and the engine stand-in share CPU 0, the gateway has CPU 1 -- as in
    # production, where the gateway does not take CPU from the engine host or the clients
    cpu_load = {min(os.sched_getaffinity(0))} if pin else None
    cpu_gw = {max(os.sched_getaffinity(0))} if pin else None
    if cpu_load:
        os.sched_setaffinity(0, cpu_load)
    scale = 0.5 if args.quick else 1.0
    levels = [(1, int(100 * scale)), (64, int(640 * scale)), (256, int(1536 * scale))]

    sp, gp = free_port(), free_port()
    standin = start([PY, "-m", "qosgate.engines.standin", "--port", str(sp),
                     "--scheduling-policy", "priority"], f"http://127.0.0.1:{sp}/health", cpu_load)
    gateway = start([*QOSGATE, "serve", "--port", str(gp), "--upstream",
                     f"http://127.0.0.1:{sp}", "--upstream-capacity", "1024",
                     "--upstream-polarity", "vllm", "--log-level", "warning"],
                    f"http://127.0.0.1:{gp}/readyz", cpu_gw)
    direct_url = f"http://127.0.0.1:{sp}/v1/chat/completions"
    gw_url = f"http://127.0.0.1:{gp}/v1/chat/completions"
    where = (f"client+stand-in pinned to CPU {min(cpu_load)}, gateway to CPU {min(cpu_gw)}"
             if cpu_load and cpu_gw else f"client, stand-in and gateway share {ncpu} CPUs")
    print(f"gateway overhead: {where}; streaming chat, {args.max_tokens} output tokens, "
          "stand-in at real speed")
    rows = []
    try:
        for conc, total in levels:
            d = run(direct_url, conc, total, args.max_tokens)
            g = run(gw_url, conc, total, args.max_tokens)
            rows.append((conc, total, d, g))
        sp2 = free_port()
        gp2 = free_port()
        stop(gateway)
        stop(standin)
        standin = start([PY, "-m", "qosgate.engines.standin", "--port", str(sp2),
                         "--scheduling-policy", "priority", "--time-scale", "0.01"],
                        f"http://127.0.0.1:{sp2}/health", cpu_load)
        gateway = start([*QOSGATE, "serve", "--port", str(gp2), "--upstream",
                         f"http://127.0.0.1:{sp2}", "--upstream-capacity", "1024",
                         "--upstream-polarity", "vllm", "--log-level", "warning"],
                        f"http://127.0.0.1:{gp2}/readyz", cpu_gw)
        n_tp = int(4000 * scale)
        d_tp = run(f"http://127.0.0.1:{sp2}/v1/chat/completions", 256, n_tp, 4, 0.0)
        g_tp = run(f"http://127.0.0.1:{gp2}/v1/chat/completions", 256, n_tp, 4, 0.0)
    finally:
        stop(gateway)
        stop(standin)

    print()
    print("latency (ms)       |        TTFT p50          |        TTFT p99          "
          "|        E2E p50           |        E2E p99")
    print("clients  requests  |  direct  gateway   added |  direct  gateway   added "
          "|  direct  gateway   added |  direct  gateway   added")
    for conc, total, d, g in rows:
        cells = []
        for series in ("ttft", "e2e"):
            for q in (50, 99):
                a = pct(getattr(d, series), q)
                b = pct(getattr(g, series), q)
                cells.append(f"{ms(a)} {ms(b)} {ms(b - a)}")
        errs = f"  (errors: {d.errors}/{g.errors})" if d.errors or g.errors else ""
        print(f"{conc:7d} {total:9d}  |" + " |".join(cells) + errs)
    print()
    print("max throughput (256 clients, 4-token streams, stand-in x100 speed)")
    print(f"  direct : {d_tp.rps:8.0f} req/s")
    print(f"  gateway: {g_tp.rps:8.0f} req/s  ({g_tp.rps / d_tp.rps:.0%} of direct)"
          + (f"  errors {g_tp.errors}" if g_tp.errors else ""))


if __name__ == "__main__":
    main()
