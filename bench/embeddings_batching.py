"""Embeddings through the gateway with dynamic batching: window off, fixed at 10/50/100 ms, and
adaptive, at three arrival rates, in one run.

    .venv/bin/python bench/embeddings_batching.py [--rates 20,60,150] [--seconds 6] [--seed 1]

A benchmark, not a test: it prints a table. One vLLM stand-in serves ``/v1/embeddings`` with its
batch cost model (one call at a time, 20 ms fixed + 50 us per input token: a single short input
costs ~20.5 ms, so unbatched it serves at most ~48 calls/s). For every (window, rate) a fresh
gateway (``upstreams`` = the stand-in, max_window 64; ``embeddings.linger`` set per row) gets an
open-loop Poisson stream of single-input requests (one sentence of 30-60 characters, seeded) for
``--seconds``; the client is aiohttp, one connection per request in flight. Per row:

- **req/s**: requests completed over the span from the first arrival to the last completion;
- **p50/p99**: client-side latency (send to the whole answer), ms;
- **batch**: mean requests per upstream call (the gateway's ``qosgate_embeddings_batch_size``);
- **window**: the window at the end of the run (adaptive: where the controller left it), ms;
- **ok**: requests answered 200 out of those sent.

Each window runs twice: with at most one batch in flight per replica (the default,
``embeddings.max_inflight_batches: 1``: while a batch runs the next fills up, as TEI does), and
with no limit (every release is an upstream call at once; batches come from the window alone,
as seeds 000/001 describe).

The adaptive row uses the defaults (floor 10 ms, ceiling 100 ms, target 150 ms per batch from
its oldest request's arrival, re-evaluated every 10 batches, smoothed with alpha 0.5).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp

PY = sys.executable
MODEL = "Qwen/Qwen2.5-7B-Instruct"
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
         "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau", "upsilon", "phi",
         "chi", "psi", "omega"]

WINDOWS: list[tuple[str, str]] = [
    ("off", "window: 'off'"),
    ("fixed 10 ms", "linger: fixed, linger_ms: 10"),
    ("fixed 50 ms", "linger: fixed, linger_ms: 50"),
    ("fixed 100 ms", "linger: fixed, linger_ms: 100"),
    ("adaptive", "linger: adaptive"),
]
INFLIGHT = (1, 0)  # batches in flight per replica: 1 (the default), 0 (no limit)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: process exited")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} not ready")


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


def sentence(rng: random.Random) -> str:
    out: list[str] = []
    n = rng.randint(30, 60)
    while len(" ".join(out)) < n:
        out.append(rng.choice(WORDS))
    return " ".join(out)


async def load(url: str, rate: float, seconds: float, seed: int
               ) -> tuple[list[float], int, int, float]:
    """Open-loop Poisson arrivals; returns (latencies of the 200s, ok, sent, span)."""
    rng = random.Random(seed)
    lat: list[float] = []
    ok = 0
    sent = 0
    start = time.perf_counter()
    last_done = start
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def one(text: str) -> None:
            nonlocal ok, last_done
            t0 = time.perf_counter()
            try:
                async with session.post(url + "/v1/embeddings",
                                        json={"model": MODEL, "input": text}) as r:
                    await r.read()
                    status = r.status
            except (aiohttp.ClientError, TimeoutError):
                return
            t1 = time.perf_counter()
            if status == 200:
                ok += 1
                lat.append(t1 - t0)
                last_done = max(last_done, t1)

        tasks: list[asyncio.Task[None]] = []
        at = start
        end = start + seconds
        while True:
            at += rng.expovariate(rate)
            if at >= end:
                break
            delay = at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(sentence(rng))))
            sent += 1
        await asyncio.gather(*tasks)
    return lat, ok, sent, last_done - start


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="20,60,150", help="arrivals per second, comma-separated")
    ap.add_argument("--seconds", type=float, default=6.0, help="load per row")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--inflight", default="1,0",
                    help="embeddings.max_inflight_batches values (0: no limit), comma-separated")
    args = ap.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    args.inflight = [int(x) for x in args.inflight.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="embbench-"))
    sport = free_port()
    stand = subprocess.Popen(
        [PY, "-m", "qosgate.standin", "--port", str(sport)],
        stdout=(tmp / "standin.log").open("wb"), stderr=subprocess.STDOUT)
    rows: list[tuple[float, int, str, float, float, float, float, float, int, int]] = []
    try:
        wait_ready(f"http://127.0.0.1:{sport}/health", stand)
        runs = [(r, i, n, w) for r in rates for i in args.inflight for n, w in WINDOWS]
        for rate, inflight, name, window in runs:
            if True:
                gport = free_port()
                cfg = tmp / f"gw-{gport}.yaml"
                cfg.write_text(
                    f"upstreams:\n  - {{url: 'http://127.0.0.1:{sport}', name: standin, "
                    f"max_window: 64}}\nembeddings: {{{window}, max_inflight_batches: "
                    f"{inflight}}}\n")
                gw = subprocess.Popen(
                    [PY, "-m", "qosgate.cli", "serve", "--port", str(gport), "--log-level",
                     "warning", "--config", str(cfg)],
                    stdout=(tmp / f"gw-{gport}.log").open("wb"), stderr=subprocess.STDOUT)
                url = f"http://127.0.0.1:{gport}"
                try:
                    wait_ready(url + "/readyz", gw)
                    lat, ok, sent, span = asyncio.run(
                        load(url, rate, args.seconds, args.seed))
                    n = metric(url, "qosgate_embeddings_batch_size_count")
                    total = metric(url, "qosgate_embeddings_batch_size_sum")
                    w = metric(url, "qosgate_embeddings_batch_window_seconds")
                finally:
                    gw.terminate()
                    gw.wait(20)
                rows.append((rate, inflight, name, ok / span if span > 0 else 0.0,
                             pct(lat, 0.5) * 1e3, pct(lat, 0.99) * 1e3,
                             total / n if n else float("nan"), w * 1e3, ok, sent))
                r = rows[-1]
                print(f"  done: rate {rate:g}/s, in flight {inflight}, {name}: {r[3]:.1f} req/s, "
                      f"p99 {r[5]:.0f} ms",
                      file=sys.stderr, flush=True)
    finally:
        stand.terminate()
        stand.wait(20)
    print()
    print(f"embeddings through the gateway, stand-in upstream (20 ms + 50 us/token per call), "
          f"{args.seconds:g} s per row, seed {args.seed}")
    print(f"| {'rate/s':>6} | {'in flight':>9} | {'window':<12} | {'req/s':>6} | "
          f"{'p50 ms':>7} | {'p99 ms':>7} | {'batch':>5} | {'window ms':>9} | {'ok/sent':>9} |")
    print(f"|{'-' * 8}|{'-' * 11}|{'-' * 14}|{'-' * 8}|{'-' * 9}|{'-' * 9}|{'-' * 7}|"
          f"{'-' * 11}|{'-' * 11}|")
    for rate, inflight, name, rps, p50, p99, batch, w, ok, sent in rows:
        fl = "no limit" if inflight == 0 else str(inflight)
        print(f"| {rate:>6g} | {fl:>9} | {name:<12} | {rps:>6.1f} | {p50:>7.1f} | {p99:>7.1f} | "
              f"{batch:>5.1f} | {w:>9.1f} | {f'{ok}/{sent}':>9} |")


if __name__ == "__main__":
    main()
