"""Scale-out: 1, 2 and 4 gateway worker processes (``qosgate serve --workers N``, one port,
SO_REUSEPORT), each without and with shared state in Redis, in front of the vLLM stand-in.

    .venv/bin/python bench/scale_out.py [--seconds S] [--rate R] [--concurrency C]

A benchmark, not a test: it prints tables. For each configuration:

- **requests/s**: closed loop, ``--concurrency`` keep-alive connections (spread over the workers
  by the kernel) sending non-streaming requests (max_tokens 4) for ``--seconds``;
- **added latency p50/p99**: open loop at ``--rate`` requests/s for ``--seconds``, each request's
  latency through the gateway less the same percentile straight to the stand-in at that rate;
- then the **limit overshoot at 4 instances**: a tenant limited to R requests/min, 4R requests
  sent at once over 4 workers, with and without Redis: admitted vs R + what refilled meanwhile.

The stand-in runs its modelled engine 100x faster (``--time-scale 0.01``) so the gateway, not the
engine, is what is measured. Everything (client included) shares this machine's cores: read the
numbers as relative.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
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
BODY = json.dumps({"model": MODEL, "max_tokens": 4,
                   "messages": [{"role": "user", "content": "hello there"}]}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, headers: dict[str, str] | None = None) -> bytes:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=2) as r:
        body: bytes = r.read()
        return body


def wait(cond: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if cond():  # type: ignore[operator]
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError("not ready in time")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


class Proc:
    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log.open("wb")
        self.p = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, PYTHONUNBUFFERED="1"))

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(15)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


def start_gateway(tmp: Path, cfg: Path, workers: int, redis_url: str | None) -> tuple[Proc, str]:
    port = free_port()
    args = [PY, "-m", "qosgate.cli", "serve", "--config", str(cfg), "--port", str(port),
            "--log-level", "warning", "--workers", str(workers)]
    if redis_url:
        args += ["--redis", redis_url]
    proc = Proc(args, tmp / f"gw-{port}.log")
    url = f"http://127.0.0.1:{port}"
    seen: set[str] = set()

    def all_up() -> bool:  # fresh connections land on every worker in turn
        st = json.loads(get(url + "/v1/qos/status", {"Authorization": "Bearer sk-admin"}))
        seen.add(st["instance"])
        live = st["shared_state"].get("live_instances", len(seen))
        return len(seen) >= workers and live >= workers

    wait(all_up, 60)
    return proc, url


async def closed_loop(url: str, key: str, conc: int, seconds: float) -> tuple[float, int]:
    """(completed requests/s, requests refused)"""
    ok = bad = 0
    end = time.monotonic() + seconds
    conn = aiohttp.TCPConnector(limit=conc, force_close=False)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def worker() -> None:
            nonlocal ok, bad
            while time.monotonic() < end:
                async with s.post(url + "/v1/chat/completions", data=BODY, headers={
                        "Authorization": f"Bearer {key}",
                        "Content-Type": "application/json"}) as r:
                    await r.read()
                    ok += r.status == 200
                    bad += r.status != 200
        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(conc)))
        return ok / (time.monotonic() - t0), bad


async def open_loop(url: str, key: str, rate: float, seconds: float) -> list[float]:
    lat: list[float] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def one() -> None:
            t = time.monotonic()
            async with s.post(url + "/v1/chat/completions", data=BODY, headers={
                    "Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as r:
                await r.read()
                if r.status == 200:
                    lat.append(time.monotonic() - t)
        tasks = []
        t0 = time.monotonic()
        n = int(rate * seconds)
        for i in range(n):
            delay = t0 + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
    return lat


async def burst(url: str, key: str, n: int) -> tuple[int, float]:
    conn = aiohttp.TCPConnector(limit=64, force_close=True)  # new connections: every worker
    async with aiohttp.ClientSession(connector=conn) as s:
        async def one() -> int:
            async with s.post(url + "/v1/chat/completions", data=BODY, headers={
                    "Authorization": f"Bearer {key}", "Content-Type": "application/json"}) as r:
                await r.read()
                return r.status
        t0 = time.monotonic()
        codes = await asyncio.gather(*(one() for _ in range(n)))
        return sum(c == 200 for c in codes), time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--rate", type=float, default=100.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--limit", type=int, default=120, help="R requests/min for the overshoot")
    args = ap.parse_args()
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        sys.exit("redis-server is needed (make test installs it: make redis-env)")
    tmp = Path(tempfile.mkdtemp(prefix="scale_out-"))
    sport, rport = free_port(), free_port()
    standin = Proc([PY, "-m", "qosgate.standin", "--port", str(sport), "--time-scale",
                    "0.01", "--max-num-seqs", "256", "--log-level", "warning"],
                   tmp / "standin.log")
    redis = Proc([redis_bin, "--port", str(rport), "--bind", "127.0.0.1", "--dir", str(tmp),
                  "--save", "", "--appendonly", "no"], tmp / "redis.log")
    redis_url = f"redis://127.0.0.1:{rport}/0"
    surl = f"http://127.0.0.1:{sport}"
    cfg = tmp / "bench.yaml"
    cfg.write_text(f"""
tenants:
  - name: bench
    api_keys: [sk-bench]
    limits: {{requests_per_minute: 10000000, max_concurrent: 100000}}
  - name: capped
    api_keys: [sk-capped]
    limits: {{requests_per_minute: {args.limit}}}
server: {{admin_keys: [sk-admin]}}
upstreams:
  - url: {surl}
    max_window: 256
""")
    try:
        wait(lambda: get(surl + "/health") is not None)
        direct = asyncio.run(open_loop(surl, "x", args.rate, args.seconds))
        d50, d99 = pct(direct, 0.5), pct(direct, 0.99)
        print(f"stand-in direct at {args.rate:.0f} req/s: p50 {d50 * 1e3:.2f} ms, "
              f"p99 {d99 * 1e3:.2f} ms ({len(direct)} requests)")
        rows = []
        for workers in (1, 2, 4):
            for url_r in (None, redis_url):
                proc, url = start_gateway(tmp, cfg, workers, url_r)
                try:
                    asyncio.run(closed_loop(url, "sk-bench", 8, 1.0))  # warm up
                    rps, refused = asyncio.run(closed_loop(url, "sk-bench", args.concurrency,
                                                     args.seconds))
                    lat = asyncio.run(open_loop(url, "sk-bench", args.rate, args.seconds))
                finally:
                    proc.stop()
                rows.append((workers, "redis" if url_r else "none", rps, refused,
                             (pct(lat, 0.5) - d50) * 1e3, (pct(lat, 0.99) - d99) * 1e3,
                             len(lat)))
        print()
        print(f"{'workers':>7} {'shared':>6} {'req/s':>8} {'added p50 ms':>13} "
              f"{'added p99 ms':>13} {'refused':>8} {'open-loop ok':>13}")
        for w, sh, rps, refused, a50, a99, nl in rows:
            print(f"{w:>7} {sh:>6} {rps:>8.0f} {a50:>13.2f} {a99:>13.2f} {refused:>8} "
                  f"{nl:>6}/{int(args.rate * args.seconds)}")
        print()
        r = args.limit
        print(f"limit overshoot at 4 instances: tenant limited to R = {r} requests/min, "
              f"{4 * r} requests at once")
        print(f"{'shared':>6} {'admitted':>9} {'R + refill':>11} {'overshoot':>10} {'s':>6}")
        for url_r in (None, redis_url):
            proc, url = start_gateway(tmp, cfg, 4, url_r)
            try:
                admitted, took = asyncio.run(burst(url, "sk-capped", 4 * r))
            finally:
                proc.stop()
            allowed = r + r * took / 60
            print(f"{'redis' if url_r else 'none':>6} {admitted:>9} {allowed:>11.1f} "
                  f"{admitted - allowed:>+10.1f} {took:>6.2f}")
            if url_r:  # a fresh bucket for the next run
                subprocess.run(["redis-cli", "-p", str(rport), "FLUSHALL"],
                               capture_output=True, check=False)
    finally:
        standin.stop()
        redis.stop()


if __name__ == "__main__":
    main()
