"""The gateway's app under two ASGI servers: ``qosgate serve`` (uvicorn, with its guarded
protocol) against granian (a Rust HTTP server), gateway CPU per streamed request.

    .venv/bin/pip install granian   # not a dependency: only this bench uses it
    .venv/bin/python bench/asgi_servers.py [--requests N] [--rounds R]

One stand-in (real speed) pinned with the client to one CPU, each server pinned to the other;
64 streaming clients (16 tokens, the overhead bench's client and think time), the servers
alternated ``--rounds`` times. CPU is counted over every thread of the server's processes
(granian runs Python and its Rust runtime in threads of their own).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

import uvloop
from gateway_overhead import (
    PY,
    QOSGATE,
    THINK_S,
    drive,
    free_port,
    pct,
    start,
    stop,
)

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_all_threads(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0]) / 1e9
    return total


def with_children(proc: subprocess.Popen[bytes]) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True)
    return [proc.pid, *(int(x) for x in found.stdout.split())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    try:
        import granian  # noqa: F401
    except ImportError:
        sys.exit("granian is not installed: .venv/bin/pip install granian")
    cpus = sorted(os.sched_getaffinity(0))
    load, gw_cpu = {cpus[0]}, {cpus[-1]}
    cfg = os.path.join(tempfile.mkdtemp(prefix="qosgate-asgi-"), "fixed.yaml")
    with open(cfg, "w") as f:
        f.write("fleet: {window: {mode: fixed}}\n")
    sp = free_port()
    upstream = f"http://127.0.0.1:{sp}"
    standin = start([PY, "-m", "qosgate.standin", "--port", str(sp),
                     "--scheduling-policy", "priority"], upstream + "/health", load)
    os.sched_setaffinity(0, load)

    def uvicorn() -> tuple[int, subprocess.Popen[bytes]]:
        gp = free_port()
        return gp, start([*QOSGATE, "serve", "--port", str(gp), "--config", cfg, "--upstream",
                          upstream, "--max-window", "1024", "--upstream-polarity", "vllm",
                          "--log-level", "warning"], f"http://127.0.0.1:{gp}/readyz", gw_cpu)

    def granian_server() -> tuple[int, subprocess.Popen[bytes]]:
        gp = free_port()
        env = dict(os.environ, QOSGATE_BENCH_UPSTREAM=upstream)
        proc = subprocess.Popen(
            [PY, "-m", "granian", "--interface", "asgi", "--loop", "uvloop", "--port", str(gp),
             "--workers", "1", "--runtime-threads", "1", "--log-level", "warning",
             "granian_app:app"], env=env, cwd=HERE, stdout=subprocess.DEVNULL)
        os.sched_setaffinity(proc.pid, gw_cpu)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{gp}/readyz", timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        return gp, proc

    print(f"one stand-in; 64 streaming clients, {args.requests} requests a run; "
          f"load average {os.getloadavg()[0]:.2f} at start")
    try:
        for _ in range(args.rounds):
            for name, launch in (("uvicorn (qosgate serve)", uvicorn),
                                 ("granian", granian_server)):
                port, proc = launch()
                try:
                    uvloop.run(drive(port, 64, 200, 16, THINK_S, 0, True))  # warm up
                    pids = with_children(proc)
                    c0 = cpu_all_threads(pids)
                    run = uvloop.run(drive(port, 64, args.requests, 16, THINK_S, 1, True))
                    used = cpu_all_threads(pids) - c0
                finally:
                    stop(proc)
                n = max(1, len(run.e2e))
                print(f"{name:24s} {len(run.e2e)} ok, {run.errors} errors; gateway CPU "
                      f"{used / n * 1e6:5.0f} us/request; TTFT p50 "
                      f"{pct(run.ttft, 50) * 1000:6.1f} ms, p99 {pct(run.ttft, 99) * 1000:6.1f} ms",
                      flush=True)
    finally:
        stop(standin)


if __name__ == "__main__":
    main()
