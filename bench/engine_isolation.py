"""The embedded engine in the gateway's process or in a child: what isolation would cost.

    .venv/bin/python bench/engine_isolation.py [--threads 2] [--batches 1,4,8] [--steps 300]
                                              [--startups 5] [--parts startup,engine,ipc]

A native crash in llama.cpp kills the process it runs in. ``qosgate serve`` runs it in-process
and checks it in a child before serving (``runtime/preflight.py``). This measures what that
check costs at start, and what moving the engine into a supervised child for good would cost
the two things the embedded engine is for: tokens reaching the event loop, and pausing a
sequence at a token boundary.

1. startup: ``qosgate serve`` from exec to ``/readyz`` 200, with and without the check
   (``--no-preflight``), ``--startups`` runs each, alternating; and the check's own time.
2. engine: the real engine (SmolLM2-135M Q4_1, the gateway's settings: 8 slots, ``n_batch``
   128, ``n_ctx`` 2048) decoding ``B`` sequences for ``--steps`` steps, driven from a uvloop
   event loop in two designs:
     - in-process (today): ``step()`` in a worker thread (``asyncio.to_thread``), pause/resume
       queued while a step runs and applied at its end (``runtime/inprocess.py``);
     - child: the engine steps in a child process that, between two steps, reads the commands
       waiting on a socketpair and applies them (acking each), then sends the step's result
       (``StepResult`` as msgpack, msgspec) in a length-prefixed frame; the loop reads them.
   Per design: the decode step (median), tokens/s, *delivery* (from the end of a step to the
   event loop holding its tokens) and *pause* (from the loop asking to pause a sequence, at a
   seeded random moment, to the loop knowing it is out of the batch: the token boundary, plus
   in the child the command's and the ack's trips).
3. ipc: the floor, without llama.cpp: a frame of ``B`` token events to a child that echoes it
   (socketpair, and ``multiprocessing.Pipe`` with pickle), round trip; and the encode + decode
   CPU time of one frame.
Medians and p99 of every sample; the machine is shared, so take the orders of magnitude.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.connection
import os
import platform
import random
import re
import signal
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from qosgate.models.llamacpp import LlamaCppEngine, default_model_path
from qosgate.models.step import Sampling, SeqSpec, StepResult, TokenEvent
from qosgate.sim.metrics import percentile

HEADER = struct.Struct("!I")
PROMPTS = [f"Write a long story about {t}." for t in (
    "a dragon", "a lighthouse keeper", "a robot painter", "a lost cat", "a mountain village",
    "a space station", "a clockmaker", "a pirate ship")]


class StepMsg(msgspec.Struct, tag="step", array_like=True):
    stamp_ns: int  # time.monotonic_ns() when the step ended (one clock for every process)
    result: StepResult


class AckMsg(msgspec.Struct, tag="ack", array_like=True):
    stamp_ns: int
    op: str
    seq_id: str


ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(StepMsg | AckMsg)


def frame(obj: Any) -> bytes:
    body = ENC.encode(obj)
    return HEADER.pack(len(body)) + body


def new_engine(threads: int, batch: int) -> LlamaCppEngine:
    """The gateway's engine (``runtime/embedded.py``: window 4 -> 8 slots, n_batch 128) with
    ``batch`` sequences that decode to the end of their context."""
    engine = LlamaCppEngine(default_model_path(), max_num_seqs=8, n_ctx_per_seq=2048,
                            n_batch=128, n_threads=threads, evict_paused=True)
    for i in range(batch):
        engine.add(SeqSpec(f"chatcmpl-{i:08x}-{i}", 1, None, sampling=Sampling(temperature=0.0),
                           messages=[{"role": "user", "content": PROMPTS[i]}]))
    return engine


@dataclass
class Run:
    steps_ms: list[float] = field(default_factory=list)
    delivery_us: list[float] = field(default_factory=list)
    pause_us: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0


WARMUP = 3  # steps before measuring: the prompts' prefill


# ---------------------------------------------------------------------------- in-process design
async def inprocess(threads: int, batch: int, steps: int, seed: int) -> Run:
    engine = new_engine(threads, batch)
    run = Run()
    ids = [f"chatcmpl-{i:08x}-{i}" for i in range(batch)]
    pending: list[tuple[str, str, int]] = []
    stepping = False
    done = asyncio.Event()
    started = asyncio.Event()  # past the prompts' prefill: pauses are measured from here

    def timed_step() -> tuple[StepResult, int]:
        res = engine.step()
        return res, time.monotonic_ns()

    def apply(op: str, sid: str, asked: int, now: int) -> None:
        getattr(engine, op)(sid)
        if op == "pause":
            run.pause_us.append((now - asked) / 1e3)

    async def stepper() -> None:
        nonlocal stepping
        t0 = 0.0
        i = 0
        while i < steps + WARMUP:
            if i == WARMUP:
                t0 = time.perf_counter()
                started.set()
            stepping = True
            res, stamp = await asyncio.to_thread(timed_step)
            stepping = False
            now = time.monotonic_ns()
            ops, pending[:] = list(pending), []
            for op, sid, asked in ops:
                apply(op, sid, asked, now)
            if not res.tokens:  # B = 1 and that one paused: nothing ran
                continue
            if i >= WARMUP:
                run.delivery_us.append((now - stamp) / 1e3)
                run.steps_ms.append(res.duration_s * 1e3)
                run.tokens += len(res.tokens)
            i += 1
        run.seconds = time.perf_counter() - t0
        done.set()

    async def pauser() -> None:
        rng = random.Random(seed)
        await started.wait()
        while not done.is_set():
            await asyncio.sleep(rng.uniform(0.05, 0.15))
            sid = rng.choice(ids)
            for op in ("pause", "resume"):
                asked = time.monotonic_ns()
                if stepping:  # as InProcessEngine._op: at the end of the step in flight
                    pending.append((op, sid, asked))
                else:
                    apply(op, sid, asked, time.monotonic_ns())
                if op == "pause":
                    while pending and not done.is_set():  # wait until it is in effect
                        await asyncio.sleep(0.001)

    try:
        await asyncio.gather(stepper(), pauser())
    finally:
        engine.close()
    return run


# ---------------------------------------------------------------------------- child design
def child_main(fd: int, threads: int, batch: int, steps: int) -> None:
    """The engine in a child: between two steps, apply the commands waiting (ack each), then
    step and send the result."""
    sock = socket.socket(fileno=fd)
    engine = new_engine(threads, batch)
    buf = bytearray()
    sent = 0
    while sent < steps + WARMUP:
        while True:
            try:
                data = sock.recv(65536, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            buf += data
        while len(buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(buf)
            if len(buf) < HEADER.size + n:
                break
            op, sid = msgspec.msgpack.decode(bytes(buf[HEADER.size:HEADER.size + n]))
            del buf[:HEADER.size + n]
            getattr(engine, op)(sid)
            sock.sendall(frame(AckMsg(time.monotonic_ns(), op, sid)))
        res = engine.step()
        if res.tokens:  # B = 1 and that one paused: nothing ran, nothing to send
            sock.sendall(frame(StepMsg(time.monotonic_ns(), res)))
            sent += 1
    engine.close()
    sock.close()


async def in_child(threads: int, batch: int, steps: int, seed: int) -> Run:
    parent, kid = socket.socketpair()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", str(kid.fileno()), str(threads), str(batch),
         str(steps)], pass_fds=[kid.fileno()])
    kid.close()
    reader, writer = await asyncio.open_connection(sock=parent)
    run = Run()
    ids = [f"chatcmpl-{i:08x}-{i}" for i in range(batch)]
    asked: dict[str, int] = {}
    done = asyncio.Event()
    started = asyncio.Event()

    async def receiver() -> None:
        t0 = 0.0
        n = 0
        while n < steps + WARMUP:
            (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
            msg = DEC.decode(await reader.readexactly(size))
            now = time.monotonic_ns()
            if isinstance(msg, AckMsg):
                if msg.op == "pause":
                    run.pause_us.append((now - asked.pop(msg.seq_id)) / 1e3)
                continue
            if n == WARMUP:
                t0 = time.perf_counter()
                started.set()
            if n >= WARMUP:
                run.delivery_us.append((now - msg.stamp_ns) / 1e3)
                run.steps_ms.append(msg.result.duration_s * 1e3)
                run.tokens += len(msg.result.tokens)
            n += 1
        run.seconds = time.perf_counter() - t0
        done.set()

    async def pauser() -> None:
        rng = random.Random(seed)
        await started.wait()
        while not done.is_set():
            await asyncio.sleep(rng.uniform(0.05, 0.15))
            if done.is_set():
                break
            sid = rng.choice(ids)
            asked[sid] = time.monotonic_ns()
            writer.write(frame(["pause", sid]))
            while sid in asked and not done.is_set():
                await asyncio.sleep(0.001)
            if done.is_set():  # the child has made its steps and is gone
                break
            writer.write(frame(["resume", sid]))

    try:
        await asyncio.gather(receiver(), pauser())
    finally:
        writer.close()
        proc.wait(60)
    return run


# ---------------------------------------------------------------------------- raw IPC
def step_frame(batch: int) -> StepMsg:
    """A decode step's result for ``batch`` sequences as the gateway would carry it."""
    return StepMsg(time.monotonic_ns(), StepResult(0.02, [
        TokenEvent(f"chatcmpl-{i:08x}-{i}", 117, " word", 3456) for i in range(batch)]))


def echo_main(fd: int) -> None:
    sock = socket.socket(fileno=fd)
    while True:
        head = sock.recv(HEADER.size, socket.MSG_WAITALL)
        if len(head) < HEADER.size:
            return
        (n,) = HEADER.unpack(head)
        sock.sendall(head + sock.recv(n, socket.MSG_WAITALL))


def pipe_echo(conn: multiprocessing.connection.Connection) -> None:
    while True:
        try:
            conn.send(conn.recv())
        except EOFError:
            return


def raw_ipc(batch: int, n: int) -> tuple[int, list[float], list[float], list[float]]:
    """(frame bytes, socketpair RTT us, Pipe RTT us, encode+decode us) for ``n`` frames."""
    msg = step_frame(batch)
    data = frame(msg)
    codec = []
    for _ in range(n):
        t = time.perf_counter_ns()
        DEC.decode(ENC.encode(msg))
        codec.append((time.perf_counter_ns() - t) / 1e3)
    parent, kid = socket.socketpair()
    proc = subprocess.Popen([sys.executable, __file__, "--echo", str(kid.fileno())],
                            pass_fds=[kid.fileno()])
    kid.close()
    sock_rtt = []
    for _ in range(n):
        t = time.perf_counter_ns()
        parent.sendall(data)
        parent.recv(len(data), socket.MSG_WAITALL)
        sock_rtt.append((time.perf_counter_ns() - t) / 1e3)
    parent.close()
    proc.wait(10)
    ctx = multiprocessing.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=pipe_echo, args=(b,))
    p.start()
    b.close()
    pipe_rtt = []
    for _ in range(n):
        t = time.perf_counter_ns()
        a.send(msg.result)
        a.recv()
        pipe_rtt.append((time.perf_counter_ns() - t) / 1e3)
    a.close()
    p.join(10)
    return len(data), sock_rtt, pipe_rtt, codec


# ---------------------------------------------------------------------------- start-up
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def startup(extra: list[str], threads: int, tmp: Path) -> tuple[float, float | None]:
    """(seconds from exec to /readyz 200, the check's own seconds from the banner)."""
    port = free_port()
    log = tmp / f"serve-{port}.log"
    t0 = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qosgate.cli", "serve", "--port", str(port), "--log-level",
             "warning", "--threads", str(threads), *extra],
            stdout=out, stderr=subprocess.STDOUT,
            env=dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="300",
                     XDG_STATE_HOME=str(tmp / "state")))
        try:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"serve exited: {log.read_text()}")
                try:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1):
                        break
                except OSError:
                    time.sleep(0.02)
            ready = time.monotonic() - t0
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    m = re.search(r"decoded \d+ tokens in ([\d.]+) s", log.read_text())
    return ready, float(m.group(1)) if m else None


# ---------------------------------------------------------------------------- report
def q(xs: list[float], p: float) -> float:
    v = percentile(sorted(xs), p)
    return float("nan") if v is None else v


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--batches", default="1,4,8")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--startups", type=int, default=5)
    ap.add_argument("--ipc-frames", type=int, default=5000)
    ap.add_argument("--parts", default="startup,engine,ipc")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    parts = args.parts.split(",")
    print(f"SmolLM2-135M-Instruct Q4_1, llama.cpp CPU, {args.threads} threads; python "
          f"{platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; "
          f"load average {os.getloadavg()[0]:.1f} at the start")
    try:
        import uvloop  # the gateway's loop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:  # pragma: no cover
        pass

    if "startup" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            with_check: list[float] = []
            without: list[float] = []
            checks: list[float] = []
            for _ in range(args.startups):
                ready, check = startup([], args.threads, Path(tmp))
                with_check.append(ready)
                if check is not None:
                    checks.append(check)
                without.append(startup(["--no-preflight"], args.threads, Path(tmp))[0])
        print(f"\nstart-up: exec to /readyz 200 ({args.startups} runs each, alternating)")
        print(f"{'':>16} | {'median s':>8} | {'min s':>6} | {'max s':>6}")
        for name, xs in (("with the check", with_check), ("--no-preflight", without),
                         ("the check alone", checks)):
            if xs:
                print(f"{name:>16} | {statistics.median(xs):>8.2f} | {min(xs):>6.2f} | "
                      f"{max(xs):>6.2f}")

    if "engine" in parts:
        print(f"\nthe engine driven from the event loop, {args.steps} decode steps per run "
              "(delivery: step end -> loop has its tokens; pause: asked -> known out of batch)")
        print(f"{'B':>2} | {'design':>10} | {'step ms':>7} | {'tok/s':>6} | "
              f"{'delivery p50 us':>15} | {'p99 us':>7} | {'pause p50 ms':>12} | "
              f"{'p99 ms':>6} | {'pauses':>6}")
        for b in batches:
            for name, fn in (("in-process", inprocess), ("child", in_child)):
                run = asyncio.run(fn(args.threads, b, args.steps, seed=b))
                print(f"{b:>2} | {name:>10} | {statistics.median(run.steps_ms):>7.1f} | "
                      f"{run.tokens / run.seconds:>6.1f} | {q(run.delivery_us, 50):>15.0f} | "
                      f"{q(run.delivery_us, 99):>7.0f} | {q(run.pause_us, 50) / 1e3:>12.1f} | "
                      f"{q(run.pause_us, 99) / 1e3:>6.1f} | {len(run.pause_us):>6}")

    if "ipc" in parts:
        print(f"\nraw IPC, no llama.cpp: one decode step's frame to a child and back "
              f"({args.ipc_frames} frames each)")
        print(f"{'B':>2} | {'frame bytes':>11} | {'socketpair RTT p50 us':>21} | {'p99 us':>6} | "
              f"{'Pipe+pickle RTT p50 us':>22} | {'p99 us':>6} | {'encode+decode us':>16}")
        for b in batches:
            size, sock_rtt, pipe_rtt, codec = raw_ipc(b, args.ipc_frames)
            print(f"{b:>2} | {size:>11} | {q(sock_rtt, 50):>21.1f} | {q(sock_rtt, 99):>6.1f} | "
                  f"{q(pipe_rtt, 50):>22.1f} | {q(pipe_rtt, 99):>6.1f} | "
                  f"{q(codec, 50):>16.1f}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        fd, threads, batch, steps = (int(a) for a in sys.argv[2:6])
        child_main(fd, threads, batch, steps)
    elif len(sys.argv) > 1 and sys.argv[1] == "--echo":
        echo_main(int(sys.argv[2]))
    else:
        main()
