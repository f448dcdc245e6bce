"""Gateway overhead: latency added over going straight to the engine, CPU per request, max req/s.

    .venv/bin/python bench/gateway_overhead.py [--quick] [--no-pin] [--kinds stream,whole]

Starts the vLLM stand-in (simulated 7B model on an H100, real-time step durations) and a gateway
in front of it (window 1024 so that it never queues: this measures the proxy path, not
scheduling), then drives both with the same client, chat requests in closed loops of 1, 64 and
256 concurrent clients, of both kinds in one run: streamed (``"stream": true``) and whole (no
``stream``: the gateway asks the engine for a stream anyway and assembles the answer, so its cost
per request differs). Reported per kind and level: TTFT (to the first body bytes; for a whole
answer, its end) and end-to-end p50/p99, direct and through the gateway, and the difference.
Each client pauses a random 0-50 ms between requests, so that arrivals do not fall into lockstep
with the engine's steps (in lockstep, one step's phase would swamp the sub-millisecond
differences measured).
Then max requests/s: 256 concurrent clients, short requests (4 tokens) of each kind with the
stand-in sped up x100, direct vs through the gateway.

Fairness and noise:

- the same client, the same stand-in process (same engine speed) for both paths; direct and
  gateway runs alternate in rounds (D G G D D G ...) so that load from other jobs on the machine
  falls on both alike;
- the client is a minimal HTTP/1.1 client (an ``asyncio.Protocol`` around httptools, one
  kept-alive connection per simulated user, the request bytes built once): it timestamps a
  response's first body bytes in the socket callback itself, and costs the shared CPU little;
- wall-clock latencies on a shared machine are noisy, so the gateway's **CPU time per request**
  (its process's CPU time from ``/proc/<pid>/schedstat``, or ``utime + stime`` from
  ``/proc/<pid>/stat``, divided by the requests it served) is reported as well: it depends much
  less on what else runs, and on a machine where the client, the engine and the gateway share
  cores it is what turns into added latency. At 1 client it is mostly the cost of waking up for
  every streamed chunk (on the development VM a sleep-to-wake-up round trip alone costs ~90 us
  of CPU), at 64 and more the cost of the work itself.

Pinned (default with >= 2 CPUs): the client and the stand-in share one CPU, the gateway has
another, as in production where the gateway does not take CPU from the engine host or the clients.
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
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field

import httptools
import uvloop

PY = sys.executable
QOSGATE = [PY, "-m", "qosgate.cli"]
MODEL = "Qwen/Qwen2.5-7B-Instruct"
THINK_S = 0.05  # each client pauses uniform(0, THINK_S) between requests
ROUNDS = 6  # direct and gateway runs alternate, each level split in this many rounds
_TICK = os.sysconf("SC_CLK_TCK")


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


def cpu_seconds(pid: int) -> float:
    """CPU time of a process (user + system), in seconds: the scheduler's own count in ns
    (``/proc/<pid>/schedstat``) where there is one, else ``utime + stime`` (clock ticks)."""
    try:
        with open(f"/proc/{pid}/schedstat", "rb") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


# ---------------------------------------------------------------------- the client
class _Conn(asyncio.Protocol):
    """One simulated user's kept-alive connection: a request at a time."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[tuple[int, float | None, float]] | None = None
        self.first: float | None = None
        self.now = 0.0
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.now = time.perf_counter()
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if self.first is None:
            self.first = self.now

    def on_message_complete(self) -> None:
        done = self.done
        if done is not None and not done.done():
            done.set_result((self.parser.get_status_code(), self.first, self.now))

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        done = self.done
        if done is not None and not done.done():
            done.set_exception(ConnectionError("connection lost"))

    def send(self, request: bytes) -> asyncio.Future[tuple[int, float | None, float]]:
        self.first = None
        self.done = self.loop.create_future()
        assert self.transport is not None
        self.transport.write(request)
        return self.done


@dataclass
class Run:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    wall: float = 0.0
    errors: int = 0
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds in the runs

    @property
    def rps(self) -> float:
        return len(self.e2e) / self.wall if self.wall else 0.0

    def add(self, other: Run) -> None:
        self.ttft += other.ttft
        self.e2e += other.e2e
        self.wall += other.wall
        self.errors += other.errors
        for k, v in other.cpu.items():
            self.cpu[k] = self.cpu.get(k, 0.0) + v


def request_bytes(port: int, max_tokens: int, stream: bool) -> bytes:
    """A chat request; ``stream`` False: no ``stream`` member, as the ``openai`` client sends."""
    body = (
        b'{"model":"' + MODEL.encode() + b'","messages":[{"role":"user","content":"'
        + b"Tell me something interesting about queues."
        + b'"}],' + (b'"stream":true,' if stream else b"") + b'"max_tokens":'
        + str(max_tokens).encode() + b"}"
    )
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        "Content-Type: application/json\r\nAuthorization: Bearer bench\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


async def drive(port: int, conc: int, total: int, max_tokens: int, think: float, seed: int,
                stream: bool) -> Run:
    request = request_bytes(port, max_tokens, stream)
    loop = asyncio.get_running_loop()
    run = Run()
    left = total
    rng = random.Random(seed)

    async def connect() -> _Conn:
        _, conn = await loop.create_connection(_Conn, "127.0.0.1", port)
        return conn

    async def worker() -> None:
        nonlocal left
        conn = await connect()
        if think:  # users arrive spread out, not all in the same engine step
            await asyncio.sleep(rng.uniform(0, think))
        while left > 0:
            left -= 1
            if conn.lost:
                conn = await connect()
            t0 = time.perf_counter()
            try:
                status, first, t1 = await conn.send(request)
            except ConnectionError:
                run.errors += 1
                continue
            if status != 200:
                run.errors += 1
                continue
            run.ttft.append((first or t1) - t0)
            run.e2e.append(t1 - t0)
            if think:  # a random pause keeps the clients out of lockstep with the steps
                await asyncio.sleep(rng.uniform(0, think))
        assert conn.transport is not None
        conn.transport.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    run.wall = time.perf_counter() - t0
    return run


def measured(port: int, conc: int, total: int, max_tokens: int, think: float, seed: int,
             stream: bool, procs: dict[str, int]) -> Run:
    before = {k: cpu_seconds(pid) for k, pid in procs.items()}
    c0 = time.process_time()
    run = uvloop.run(drive(port, conc, total, max_tokens, think, seed, stream))
    run.cpu = {k: cpu_seconds(pid) - before[k] for k, pid in procs.items()}
    run.cpu["client"] = time.process_time() - c0
    return run


def compare(direct: int, gateway: int, conc: int, total: int, max_tokens: int, think: float,
            stream: bool, procs: dict[str, int]) -> tuple[Run, Run]:
    """Direct and gateway runs of ``total`` requests each, alternating in ROUNDS rounds."""
    for port in (direct, gateway):  # warm up: connections, caches, the engine's batch
        uvloop.run(drive(port, conc, max(conc, 16), max_tokens, think, 0, stream))
    d, g = Run(), Run()
    per = max(1, total // ROUNDS)
    for r in range(ROUNDS):
        order = [(direct, d), (gateway, g)] if r % 2 == 0 else [(gateway, g), (direct, d)]
        for port, acc in order:
            acc.add(measured(port, conc, per, max_tokens, think, 1000 * r + conc, stream,
                             procs))
    return d, g


def ms(x: float) -> str:
    return f"{x * 1000:8.2f}"


def us_per(run: Run, who: str) -> str:
    n = len(run.e2e)
    return f"{run.cpu.get(who, 0.0) / n * 1e6:7.0f}" if n else "      -"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests per level")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-pin", action="store_true",
                    help="do not pin: client, stand-in and gateway share every core")
    ap.add_argument("--kinds", default="stream,whole",
                    help="which requests: stream (streamed), whole (not streamed), or both")
    args = ap.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or set(kinds) - {"stream", "whole"}:
        ap.error("--kinds takes stream, whole or stream,whole")
    ncpu = len(os.sched_getaffinity(0))
    pin = not args.no_pin and ncpu >= 2
    # pinned: the client and the engine stand-in share one CPU, the gateway has another -- as in
    # production, where the gateway does not take CPU from the engine host or the clients
    cpu_load = {min(os.sched_getaffinity(0))} if pin else None
    cpu_gw = {max(os.sched_getaffinity(0))} if pin else None
    if cpu_load:
        os.sched_setaffinity(0, cpu_load)
    scale = 0.5 if args.quick else 1.0
    levels = [(1, int(400 * scale)), (64, int(3600 * scale)), (256, int(7200 * scale))]

    # a fixed window of 1024: the adaptive one (the default) starts at 8 and would queue the
    # 64- and 256-client levels in the gateway, measuring the window instead of the proxy path
    cfg_dir = tempfile.mkdtemp(prefix="qosgate-overhead-")
    fixed_window = os.path.join(cfg_dir, "fixed-window.yaml")
    with open(fixed_window, "w") as f:
        f.write("fleet: {window: {mode: fixed}}\n")

    def launch(time_scale: str) -> tuple[subprocess.Popen[bytes], subprocess.Popen[bytes],
                                          int, int]:
        sp, gp = free_port(), free_port()
        standin = start([PY, "-m", "qosgate.standin", "--port", str(sp),
                         "--scheduling-policy", "priority", "--time-scale", time_scale],
                        f"http://127.0.0.1:{sp}/health", cpu_load)
        gateway = start([*QOSGATE, "serve", "--port", str(gp), "--config", fixed_window,
                         "--upstream", f"http://127.0.0.1:{sp}", "--max-window", "1024",
                         "--upstream-polarity", "vllm", "--log-level", "warning"],
                        f"http://127.0.0.1:{gp}/readyz", cpu_gw)
        return standin, gateway, sp, gp

    where = (f"client+stand-in pinned to CPU {min(cpu_load)}, gateway to CPU {min(cpu_gw)}"
             if cpu_load and cpu_gw else f"client, stand-in and gateway share {ncpu} CPUs")
    load0 = os.getloadavg()[0]
    print(f"gateway overhead: {where}; chat ({', '.join(kinds)}), {args.max_tokens} output "
          f"tokens, stand-in at real speed; load average {load0:.2f} at start", flush=True)
    rows = []
    standin, gateway, sp, gp = launch("1.0")
    try:
        procs = {"gateway": gateway.pid, "standin": standin.pid}
        for kind in kinds:
            for conc, total in levels:
                d, g = compare(sp, gp, conc, total, args.max_tokens, THINK_S, kind == "stream",
                               procs)
                rows.append((kind, conc, len(g.e2e), d, g))
        stop(gateway)
        stop(standin)
        standin, gateway, sp, gp = launch("0.01")
        procs = {"gateway": gateway.pid, "standin": standin.pid}
        tput = {kind: compare(sp, gp, 256, int(9000 * scale), 4, 0.0, kind == "stream", procs)
                for kind in kinds}
    finally:
        stop(gateway)
        stop(standin)

    print()
    print("latency (ms)              |        TTFT p50          |        TTFT p99          "
          "|        E2E p50           |        E2E p99")
    print("kind    clients  requests  |  direct  gateway   added |  direct  gateway   added "
          "|  direct  gateway   added |  direct  gateway   added")
    for kind, conc, total, d, g in rows:
        cells = []
        for series in ("ttft", "e2e"):
            for q in (50, 99):
                a = pct(getattr(d, series), q)
                b = pct(getattr(g, series), q)
                cells.append(f"{ms(a)} {ms(b)} {ms(b - a)}")
        errs = f"  (errors: {d.errors}/{g.errors})" if d.errors or g.errors else ""
        print(f"{kind:<6} {conc:7d} {total:9d}  |" + " |".join(cells) + errs)
    print()
    print("CPU per request (us)         | gateway | stand-in: direct  via gw "
          "| client: direct  via gw")
    for label, d, g in [*((f"{k:<6} {c:4d} clients", d, g) for k, c, _, d, g in rows),
                        *((f"{k:<6} max req/s run", d, g) for k, (d, g) in tput.items())]:
        print(f"{label:<28} | {us_per(g, 'gateway')} |          {us_per(d, 'standin')}"
              f" {us_per(g, 'standin')} |        {us_per(d, 'client')} {us_per(g, 'client')}")
    print()
    print("max throughput (256 clients, 4-token requests, stand-in x100 speed)")
    for kind, (d_tp, g_tp) in tput.items():
        print(f"  {kind:<6} direct : {d_tp.rps:8.0f} req/s")
        print(f"  {kind:<6} gateway: {g_tp.rps:8.0f} req/s  ({g_tp.rps / d_tp.rps:.0%} of direct)"
              + (f"  errors {g_tp.errors}" if g_tp.errors else ""))
    print(f"load average {os.getloadavg()[0]:.2f} at the end (2 CPUs; other jobs included)")


if __name__ == "__main__":
    main()
