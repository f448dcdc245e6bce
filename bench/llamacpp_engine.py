"""The embedded llama.cpp engine: the gain of batching, and realtime TTFT with preemption on/off.

    .venv/bin/python bench/llamacpp_engine.py [--threads 2] [--tokens 64] [--realtime 20]

1. Batching, directly on ``LlamaCppEngine`` (no gateway): 1, 2, 4 and 8 sequences generate
   ``--tokens`` tokens each (greedy, distinct prompts) in one llama.cpp context; output tokens/s
   over the whole run (prefill included), the mean decode step (every sequence past its prompt)
   and the decode tokens/s it gives, each with its gain over 1 sequence.
   Best of ``--repeats`` runs (the machine is shared; the best run is the least disturbed one).
2. Realtime TTFT under offline load, through the gateway: ``qosgate serve`` (default engine:
   window 4, 8 KV slots) in a subprocess; 8 closed-loop offline streams (96 tokens each) keep the
   window full and 4 more queued; ``--realtime`` realtime streams (16 tokens) arrive one every
   ~1 s (fixed jitter). Three runs, one per mode:
     - pause:   the default -- a realtime arrival pauses the most recently dispatched offline
                sequence at a token boundary (KV kept) and resumes it later;
     - no-pause (--no-pause): the core may only pull back a request that has not sent its first
                token (what a gateway in front of vLLM can do): here, queued offline requests
                already hold no slot, so realtime waits for a slot like the rest;
     - off:     realtime may not preempt at all (``can_preempt: false``).
   TTFT = client send to first content chunk; p99 of 20 samples is the worst but a fraction.
   Deadline admission is off for every class, so that no mode refuses realtime requests (with
   the defaults, a realtime request predicted to wait over its 1 s budget gets a 503 at once)
   and the TTFT distributions compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from qosgate.config import default_config
from qosgate.models.llamacpp import LlamaCppEngine, default_model_path
from qosgate.models.step import Sampling, SeqSpec
from qosgate.sim.metrics import percentile

STORY = "Write a long story about {}."
TOPICS = [
    "a dragon", "a lighthouse keeper", "a robot painter", "a lost cat", "a mountain village",
    "a space station", "a clockmaker", "a pirate ship", "a desert caravan", "a winter forest",
]


# ---------------------------------------------------------------------------------- batching
def batching(threads: int, tokens: int, repeats: int) -> list[tuple[int, float, float]]:
    """(sequences, output tokens/s, mean decode step ms) per batch size, best of ``repeats``."""
    rows = []
    engine = LlamaCppEngine(default_model_path(), max_num_seqs=8, n_ctx_per_seq=512,
                            n_threads=threads)
    try:
        for n in (1, 2, 4, 8):
            best: tuple[float, float] | None = None
            for rep in range(repeats):
                for i in range(n):
                    engine.add(SeqSpec(
                        f"s{n}-{rep}-{i}", 0, tokens, sampling=Sampling(temperature=0.0),
                        messages=[{"role": "user", "content": STORY.format(TOPICS[i])}],
                    ))
                produced = 0
                decode_s: list[float] = []
                t0 = time.perf_counter()
                while engine.has_work():
                    r = engine.step()
                    produced += len(r.tokens)
                    if r.tokens and len(r.tokens) == n and not any(
                        s.n_generated <= 1 for s in engine._seqs.values()
                    ):
                        decode_s.append(r.duration_s)
                wall = time.perf_counter() - t0
                tps = produced / wall
                step_ms = 1000 * sum(decode_s) / max(1, len(decode_s))
                if best is None or tps > best[0]:
                    best = (tps, step_ms)
            assert best is not None
            rows.append((n, best[0], best[1]))
    finally:
        engine.close()
    return rows


# ---------------------------------------------------------------------------------- TTFT
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Gateway:
    def __init__(self, args: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log.open("wb")
        cmd = [sys.executable, "-m", "qosgate.cli", "serve", "--port", str(self.port),
               "--log-level", "warning", *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gateway exited; see {log}")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"gateway not ready; see {log}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@dataclass
class Load:
    rt_ttft: list[float] = field(default_factory=list)
    rt_refused: int = 0
    off_ttft: list[float] = field(default_factory=list)
    off_tokens: int = 0
    seconds: float = 0.0


async def stream(
    client: httpx.AsyncClient, cls: str, content: str, max_tokens: int,
    tokens: list[int] | None = None,
) -> tuple[float | None, int, int]:
    """(TTFT, content chunks, status) of one streaming chat request; ``tokens[0]`` counts the
    chunks while ``tokens`` is given and has one element."""
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "temperature": 0.7, "seed": random.randrange(1 << 30)}
    sent = time.monotonic()
    ttft: float | None = None
    chunks = 0
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"x-qos-class": cls}) as r:
        if r.status_code != 200:
            await r.aread()
            code = r.json().get("error", {}).get("code", "?")
            print(f"    {cls} refused: HTTP {r.status_code} {code}", file=sys.stderr)
            return None, 0, r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            if delta.get("content"):
                chunks += 1
                if tokens is not None and len(tokens) == 1:
                    tokens[0] += 1
                if ttft is None:
                    ttft = time.monotonic() - sent
    return ttft, chunks, 200


async def offered_load(url: str, n_realtime: int, seed: int, interval: float = 1.0) -> Load:
    rng = random.Random(seed)
    load = Load()
    stop = asyncio.Event()
    counted: list[int] = []  # offline chunks, counted while realtime requests arrive
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def offline_worker(k: int) -> None:
            i = 0
            while not stop.is_set():
                ttft, _, _ = await stream(
                    client, "offline", STORY.format(TOPICS[(k + i) % len(TOPICS)]), 96, counted
                )
                i += 1
                if ttft is not None and not stop.is_set():
                    load.off_ttft.append(ttft)

        workers = [asyncio.create_task(offline_worker(k)) for k in range(8)]
        await asyncio.sleep(4.0)  # the window fills and the first generations are under way
        t0 = time.monotonic()
        counted.append(0)
        rts = []
        for i in range(n_realtime):
            rts.append(asyncio.create_task(
                stream(client, "realtime", f"Say hello to {TOPICS[i % len(TOPICS)]}.", 16)
            ))
            await asyncio.sleep(interval * rng.uniform(0.5, 1.5))
        for ttft, _, _ in await asyncio.gather(*rts):
            if ttft is None:
                load.rt_refused += 1
            else:
                load.rt_ttft.append(ttft)
        load.seconds = time.monotonic() - t0
        load.off_tokens = counted.pop()
        stop.set()
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
    return load


def bench_config(path: Path, preempt: bool) -> Path:
    """The default classes, but realtime is never refused by deadline admission (so that every
    mode serves all realtime requests and the TTFT distributions compare), and with
    ``preempt=False`` no class may preempt."""
    d = default_config().model_dump(mode="json")
    for c in d["classes"]:
        c["deadline_admission"] = False
        if not preempt:
            c["can_preempt"] = False
    path.write_text(yaml.safe_dump(d))
    return path


def ttft_runs(n_realtime: int, threads: int, only: list[str]) -> list[tuple[str, Load]]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        on = str(bench_config(Path(tmp) / "on.yaml", preempt=True))
        off = str(bench_config(Path(tmp) / "off.yaml", preempt=False))
        modes = [
            ("pause", ["--config", on]),
            ("no-pause", ["--config", on, "--no-pause"]),
            ("off", ["--config", off]),
        ]
        for name, extra in modes:
            if name not in only:
                continue
            gw = Gateway(["--threads", str(threads), *extra], Path(tmp) / f"{name}.log")
            try:
                out.append((name, asyncio.run(offered_load(gw.url, n_realtime, seed=1))))
            finally:
                gw.stop()
    return out


def ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:,.0f}"


def print_batching(rows: list[tuple[int, float, float]], tokens: int) -> None:
    print(f"\nbatching (direct on LlamaCppEngine, {tokens} tokens per sequence, greedy)")
    print(f"{'sequences':>9} | {'output tok/s':>12} | {'gain':>5} | {'decode step ms':>14} | "
          f"{'decode tok/s':>12} | {'gain':>5}")
    base, base_dec = rows[0][1], 1000 / rows[0][2]
    for n, tps, step_ms in rows:
        dec = n * 1000 / step_ms
        print(f"{n:>9} | {tps:>12.1f} | {tps / base:>4.1f}x | {step_ms:>14.1f} | {dec:>12.1f} | "
              f"{dec / base_dec:>4.1f}x")


def print_ttft(runs: list[tuple[str, Load]], n_realtime: int) -> None:
    print("\nrealtime TTFT under offline load (qosgate serve: window 4, 8 slots; 8 closed-loop "
          f"offline streams x 96 tokens; {n_realtime} realtime x 16 tokens)")
    print(f"{'mode':>8} | {'rt p50 ms':>9} | {'rt p99 ms':>9} | {'rt refused':>10} | "
          f"{'offline p50 ms':>14} | {'offline tok/s':>13}")
    for name, load in runs:
        rt = sorted(load.rt_ttft)
        off = sorted(load.off_ttft)
        print(f"{name:>8} | {ms(percentile(rt, 50)):>9} | {ms(percentile(rt, 99)):>9} | "
              f"{load.rt_refused:>10} | {ms(percentile(off, 50)):>14} | "
              f"{load.off_tokens / load.seconds:>13.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--realtime", type=int, default=20)
    ap.add_argument("--modes", default="pause,no-pause,off", help="TTFT runs to make")
    ap.add_argument("--no-batching", action="store_true", help="skip part 1")
    args = ap.parse_args()
    print(f"SmolLM2-135M-Instruct Q4_1, llama.cpp CPU, {args.threads} threads; "
          f"python {platform.python_version()} on {platform.machine()}, "
          f"{os.cpu_count()} CPUs")
    if not args.no_batching:
        print_batching(batching(args.threads, args.tokens, args.repeats), args.tokens)
    print_ttft(ttft_runs(args.realtime, args.threads, args.modes.split(",")), args.realtime)


if __name__ == "__main__":
    main()
