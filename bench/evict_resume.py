"""Evict and resume through the engine, and mid-stream failover, on real processes: vLLM stand-ins
(vLLM 0.32's priority rule: a waiting request never preempts a running one) behind the gateway.

    .venv/bin/python bench/evict_resume.py flood [--seconds 50] [--time-scale 4]
    .venv/bin/python bench/evict_resume.py kill [--streams 64]

A benchmark, not a test: it prints what happened.

``flood`` -- realtime beside a running flood. Two stand-ins of 8 slots each (the gateway's window
8 per replica), 32 offline streams kept running (each client starts its next as soon as one
ends), realtime requests arriving at 1/s (Poisson) for ``--seconds``. Three runs on fresh
processes: realtime alone; the flood with no eviction (offline ``resume: false``: pulled back
only before its first byte, as before); the flood with the defaults (offline streams evicted and
resumed). Printed: realtime TTFT p50/p99 (sent to the first SSE event), the flood's tokens per
second (streamed to its clients over the realtime span), evictions and prompt tokens sent again
per eviction (the gateway's metrics).

``kill`` -- kill -9 of one of three replicas with ``--streams`` greedy streams in flight. Each
stream's text is compared with the same request's text on an undisturbed fleet (the stand-in's
tokens follow from the prompt's ids, as a greedy model's do). Printed: client-visible errors,
streams moved, and streams whose text differs from the undisturbed run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.fleet_faults import free_port, metrics, pct, start, stop  # noqa: E402
from qosgate import config as qconfig  # noqa: E402

PY = sys.executable
MODEL = "Qwen/Qwen2.5-7B-Instruct"


@dataclass(slots=True)
class Stream:
    """One streamed request as its client saw it."""

    cls: str
    marker: str
    max_tokens: int
    prompt_chars: int
    sent: float = 0.0
    first: float | None = None
    end: float | None = None
    tokens: int = 0
    text: str = ""
    outcome: str = "unresolved"  # completed | error_event | http_<status> | transport
    token_times: list[float] = field(default_factory=list)


async def stream(port: int, s: Stream) -> None:
    body = json.dumps({
        "model": MODEL, "stream": True, "max_tokens": s.max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": f"{s.marker} " + "x" * s.prompt_chars}],
    }).encode()
    s.sent = time.monotonic()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        s.outcome, s.end = "transport", time.monotonic()
        return
    writer.write((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  f"application/json\r\nx-qos-class: {s.cls}\r\nConnection: close\r\n"
                  f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
    try:
        status = int((await reader.readline()).split()[1])
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        if status != 200:
            s.outcome = f"http_{status}"
            return
        while line := await reader.readline():
            if not line.startswith(b"data: "):
                continue
            now = time.monotonic()
            if s.first is None:
                s.first = now
            payload = line[6:].strip()
            if payload == b"[DONE]":
                if s.outcome == "unresolved":
                    s.outcome = "completed"
                continue
            ev = json.loads(payload)
            if "error" in ev:
                s.outcome = "error_event"
                continue
            for c in ev.get("choices", []):
                text = c.get("delta", {}).get("content")
                if text:
                    s.text += text
                    s.tokens += 1
                    s.token_times.append(now)
    except (OSError, ValueError, IndexError):
        s.outcome = "transport"
    finally:
        s.end = time.monotonic()
        writer.close()


def standins(tmp: Path, n: int, slots: int, scale: float) -> tuple[list[Any], list[str]]:
    ports = [free_port() for _ in range(n)]
    procs = [start([PY, "-m", "qosgate.standin", "--port", str(p), "--scheduling-policy",
                    "priority", "--max-num-seqs", str(slots), "--time-scale", str(scale)],
                   f"http://127.0.0.1:{p}/health", tmp / f"standin-{p}.log") for p in ports]
    return procs, [f"http://127.0.0.1:{p}" for p in ports]


def gateway(tmp: Path, urls: list[str], window: int, resume: bool) -> tuple[Any, int]:
    classes = [c.model_dump(exclude_none=True) for c in qconfig.default_config().classes]
    for c in classes:
        if c["name"] in ("batch", "offline"):
            c["resume"] = resume
    cfg = {"classes": classes,
           "fleet": {"window": {"mode": "fixed"}},
           "upstreams": [{"url": u, "name": f"r{i}", "max_window": window,
                          "priority_polarity": "vllm"} for i, u in enumerate(urls)]}
    path = tmp / f"gateway-{time.monotonic_ns()}.json"
    path.write_text(json.dumps(cfg))
    port = free_port()
    proc = start([PY, "-m", "qosgate.cli", "serve", "--port", str(port), "--config", str(path),
                  "--log-level", "warning"], f"http://127.0.0.1:{port}/readyz",
                 tmp / f"gateway-{port}.log")
    return proc, port


def counter(port: int, name: str) -> float:
    return sum(v for _, v in metrics(f"http://127.0.0.1:{port}").get(name, []))


# ---------------------------------------------------------------------- flood
async def flood_run(port: int, seconds: float, flood: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    stop_at = time.monotonic() + 5 + seconds  # 5 s for the flood to fill every slot first
    floods: list[Stream] = []

    async def worker(k: int) -> None:
        i = 0
        while time.monotonic() < stop_at:
            s = Stream("offline", f"flood-{k}-{i}", 256, 800)
            floods.append(s)
            await stream(port, s)
            i += 1

    workers = [asyncio.create_task(worker(k)) for k in range(flood)]
    if flood:
        await asyncio.sleep(5)
    t0 = time.monotonic()
    rts: list[Stream] = []
    tasks = []
    while time.monotonic() < t0 + seconds:
        s = Stream("realtime", f"rt-{len(rts)}", 32, 200)
        rts.append(s)
        tasks.append(asyncio.create_task(stream(port, s)))
        await asyncio.sleep(rng.expovariate(1.0))
    t1 = time.monotonic()
    await asyncio.gather(*tasks)
    await asyncio.gather(*workers)
    ttft = [s.first - s.sent for s in rts if s.first is not None]
    tokens = sum(sum(1 for t in s.token_times if t0 <= t < t1) for s in floods)
    bad = [s.outcome for s in rts + floods if s.outcome != "completed"]
    return {"rt": len(rts), "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "flood_tok_s": tokens / (t1 - t0) if flood else None, "not_completed": len(bad)}


def flood(args: argparse.Namespace) -> None:
    print(f"2 stand-ins x {args.slots} slots (vLLM 0.32's priority rule, x{args.time_scale:g} "
          f"slower than the modelled H100), gateway window {args.slots} per replica; "
          f"{args.flood} offline streams (256 tokens, closed loop), realtime 1/s (32 tokens) "
          f"for {args.seconds:g} s", flush=True)
    rows = []
    for name, n, resume in (("realtime alone", 0, True), ("flood, no eviction", args.flood, False),
                            ("flood, evict + resume", args.flood, True)):
        with tempfile.TemporaryDirectory(prefix="qosgate-evict-") as d:
            tmp = Path(d)
            procs, urls = standins(tmp, 2, args.slots, args.time_scale)
            gw, port = gateway(tmp, urls, args.slots, resume)
            try:
                got = asyncio.run(flood_run(port, args.seconds, n, args.seed))
                ev = counter(port, "qosgate_evictions_total")
                resent = counter(port, "qosgate_resume_prompt_tokens_total")
                got["evictions"] = ev
                got["resent_per_eviction"] = resent / ev if ev else 0.0
            finally:
                stop(gw)
                for p in procs:
                    stop(p)
        rows.append((name, got))
        print(f"  {name}: {got}", flush=True)
    base = rows[1][1]["flood_tok_s"]
    alone = rows[0][1]["ttft_p99"]
    print("\n| run | realtime TTFT p50 | p99 | flood tok/s | evictions | prompt tokens sent "
          "again per eviction | not completed |")
    print("|---|---|---|---|---|---|---|")
    for name, g in rows:
        tok = "-" if g["flood_tok_s"] is None else (
            f"{g['flood_tok_s']:.0f} ({g['flood_tok_s'] / base:.2f}x)")
        p99 = f"{g['ttft_p99']:.3f} s ({g['ttft_p99'] / alone:.2f}x alone)"
        print(f"| {name} | {g['ttft_p50']:.3f} s | {p99} | {tok} | {g['evictions']:.0f} | "
              f"{g['resent_per_eviction']:.0f} | {g['not_completed']} |")


# ---------------------------------------------------------------------- kill
async def kill_run(port: int, n: int, victim: subprocess.Popen[bytes] | None,
                   out_tokens: int) -> list[Stream]:
    ss = [Stream("api", f"kill-{i}", out_tokens, 300 + 7 * i) for i in range(n)]
    tasks = [asyncio.create_task(stream(port, s)) for s in ss]
    if victim is not None:
        # once every stream has begun, kill one replica mid-stream
        while not all(s.tokens >= 3 or s.end is not None for s in ss):
            await asyncio.sleep(0.05)
        victim.send_signal(signal.SIGKILL)
    await asyncio.gather(*tasks)
    return ss


def kill(args: argparse.Namespace) -> None:
    print(f"3 stand-ins x {args.kill_slots} slots, {args.streams} greedy api streams of "
          f"{args.tokens} tokens; kill -9 of one replica once every stream has begun",
          flush=True)
    results = {}
    for name, killing in (("undisturbed", False), ("kill -9", True)):
        with tempfile.TemporaryDirectory(prefix="qosgate-kill-") as d:
            tmp = Path(d)
            procs, urls = standins(tmp, 3, args.kill_slots, args.time_scale)
            gw, port = gateway(tmp, urls, args.kill_slots, True)
            try:
                ss = asyncio.run(kill_run(port, args.streams, procs[1] if killing else None,
                                          args.tokens))
                moves = counter(port, "qosgate_moves_total")
            finally:
                stop(gw)
                for p in procs:
                    stop(p)
        results[name] = (ss, moves)
    ref = {s.marker: s.text for s in results["undisturbed"][0]}
    ss, moves = results["kill -9"]
    errors = [s for s in ss if s.outcome != "completed"]
    differ = [s for s in ss if s.outcome == "completed" and s.text != ref[s.marker]]
    short = [s for s in ss if s.outcome == "completed" and s.tokens != args.tokens]
    print("\n| streams | client-visible errors | moved | text differs from undisturbed | "
          "token count off |")
    print("|---|---|---|---|---|")
    print(f"| {len(ss)} | {len(errors)} | {moves:.0f} | {len(differ)} | {len(short)} |")
    if errors:
        print("errors:", sorted({s.outcome for s in errors}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["flood", "kill"])
    ap.add_argument("--seconds", type=float, default=50.0)
    ap.add_argument("--flood", type=int, default=32)
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--kill-slots", type=int, default=32, help="slots per replica (kill)")
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--time-scale", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    flood(args) if args.what == "flood" else kill(args)


if __name__ == "__main__":
    main()
