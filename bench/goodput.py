"""Goodput per class under 1x..5x load: does what a gateway admits under overload meet its time-
to-first-token objective? No gateway, qosgate with its defaults, and SMG (the SGLang model
gateway) in front of the same engines, real processes.

    .venv/bin/python bench/goodput.py [--quick] [--gateways direct,qosgate,smg]
        [--loads 1,2,3,5] [--duration 60] [--mix api|classes] [--retries N]
        [--client-timeout 30] [--engine standin|vllm] [--seed N] [--json PATH]

A benchmark, not a test: it prints what happened. ``--quick``: 20 s of arrivals, a shorter
probe, and by default only direct and qosgate at 1x and 3x (a few minutes).

1. **capacity**: the engines driven directly, closed-loop with exactly ``--max-num-seqs``
   streams open each (the batch full, nothing queued inside), for a probe period; the requests
   completed per second after a warm-up are what they sustain for this request shape;
2. **load phases**: for each gateway and load factor, open-loop Poisson arrivals at factor x
   capacity for ``--duration`` s (the same arrivals, from the same seed, for every gateway at a
   factor), then the stragglers are awaited. Gateways: ``direct`` (the client spreads the
   requests round-robin over the engines itself), ``qosgate`` (``qosgate serve --upstream``
   both engines, nothing else configured: the defaults) and ``smg`` (``SMG_ARGS``: SMG 1.13's
   defaults, its cache-aware router included, plus ``--worker-overload-shed``, so that it
   answers 503 + Retry-After when every worker has at least 8 requests waiting, its default
   threshold, instead of routing to the least loaded one, and ``--load-monitor-interval 1``,
   so that it reads the engines' queues every second rather than every 10). Every request
   streams, asks for ``--max-tokens``, and carries its class
   in ``x-qos-class`` (direct and SMG ignore it; the class still sets its objective). The
   client gives up on an attempt ``--client-timeout`` s after sending it (and closes it).

With ``--retries N`` a refused attempt (429 or 503) is sent again, up to N times, when the
openai Python client would send it (``bench/openai_retry.py``: the ``retry-after-ms`` or
``retry-after`` asked for, exactly, if at most 120 s; none over 120 s; exponential backoff
with jitter when none is given). The SDK also retries time-outs and other 5xx; this bench
retries refusals only.

Engines: ``standin`` (default): two stand-ins (``qosgate standin``) with ``--max-num-seqs`` 8
and ``--time-scale`` (default 4) on the default profile; ``vllm``: one real vLLM CPU engine
(SmolLM2-135M, ``--scheduling-policy priority``, 4 slots; qosgate then with
``--upstream-polarity vllm --max-window 64``, the README's configuration), defaults loads 1,3,
30 s, 32 tokens. SMG: ``--smg`` (default ``~/.cache/qosgate/smg-1.13.0/bin/smg``; install it
with ``python3 -m venv ~/.cache/qosgate/smg-1.13.0 &&
~/.cache/qosgate/smg-1.13.0/bin/pip install smg==1.13.0``).

Columns of the per-factor table, per gateway and class (and all classes):

- **sent**: requests (a retried request counts once); **completed**: its stream ended with
  ``[DONE]``;
- **in SLO**: completed with a TTFT (from its first attempt's send to the first SSE event of its
  last attempt, retries and their waits included) within its class's ``ttft_budget_ms``, read
  from qosgate's default configuration (realtime 1 s, api 5 s, batch 30 s, offline 300 s);
- **goodput/s**: in SLO / the arrival window's seconds;
- **refused (RA)**: its last attempt answered 429 or 503 (in brackets: how many of those
  answers carried a Retry-After);
- **time-outs**: its last attempt given up by the client; **other**: any other ending (an
  error event, a broken connection);
- **TTFT p50 / p90 s**: of the completed;
- **admitted met**: in SLO / the requests not refused: of what the gateway let through, the
  share that met its objective.

Sampled every ``SAMPLE_S`` during the arrivals: the gateway's ``qosgate_queue_depth`` (summed
over classes; qosgate only) and the engines' ``vllm:num_requests_waiting`` and
``vllm:num_requests_running`` (summed over engines): where the backlog sits, ordered in the
gateway or first-come-first-served in the engines. With retries: the retries sent, those not
refused again (admitted) and their share, the Retry-After asked for (p50 / p90 / max), and the
most retries sent in one 1-second bucket against the mean per second that saw any (a storm:
many in one second). Last, goodput at each factor over goodput at the lowest factor.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the one server-process wrapper lives with the tests

import uvloop  # noqa: E402

from bench import vllm_common  # noqa: E402
from bench.fleet_faults import Rec, metrics, one, one_value  # noqa: E402
from bench.goodput_report import Phase, Request, phase_json, print_tables  # noqa: E402
from bench.openai_retry import MAX_RETRY_AFTER_S, asked_delay, retry_delay  # noqa: E402
from qosgate import config as qconfig  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.processes import MODEL as STANDIN_MODEL  # noqa: E402
from tests.support.processes import Server, start_gateway, start_standin  # noqa: E402

GATEWAYS = ("direct", "qosgate", "smg")
MIXES: dict[str, tuple[tuple[str, float], ...]] = {
    "api": (("api", 1.0),),
    "classes": (("realtime", 0.2), ("api", 0.3), ("batch", 0.3), ("offline", 0.2)),
}
STANDINS, STANDIN_SEQS = 2, 8
VLLM_SEQS = 4
PROMPT_CHARS = 200
SAMPLE_S = 0.5
SMG = Path.home() / ".cache" / "qosgate" / "smg-1.13.0" / "bin" / "smg"
# shed (503 + Retry-After) when every worker has >= 8 waiting (the default threshold), judged
# on a poll every second (the default, 10 s, routes and queues blind in between); vLLM's
# metrics for the load; no tokenizer (the requests are routed, not tokenized)
SMG_ARGS = ("--backend", "vllm", "--worker-overload-shed", "--load-monitor-interval", "1",
            "--disable-tokenizer-autoload", "--log-level", "warn")


@dataclass(frozen=True)
class Shape:
    """What every phase shares: the engines, the request shape, the client."""

    engine: str
    model: str
    slots: int  # each engine's --max-num-seqs
    max_tokens: int
    client_timeout: float
    retries: int
    budgets: dict[str, float]  # class -> TTFT objective, seconds


def budgets() -> dict[str, float]:
    """Each class's TTFT objective, from qosgate's default configuration: the bench holds every
    gateway to what qosgate's classes promise, and follows them when they change."""
    return {c.name: c.ttft_budget_ms / 1000 for c in qconfig.default_config().classes}


# ---------------------------------------------------------------------- processes
def start_engines(engine: str, tmp: Path, time_scale: float) -> list[Server]:
    if engine == "vllm":
        vllm_common.build_env()
        return [vllm_common.start_vllm(tmp, "priority", VLLM_SEQS)]
    return [start_standin(tmp, "--max-num-seqs", str(STANDIN_SEQS), "--time-scale",
                          str(time_scale)) for _ in range(STANDINS)]


def start_front(gateway: str, tmp: Path, engines: list[Server], shape: Shape,
                smg: Path) -> Server | None:
    """The gateway in front of ``engines``; None for ``direct``."""
    urls = [e.url for e in engines]
    if gateway == "qosgate":
        tuned = ["--upstream-polarity", "vllm", "--max-window", "64"] if shape.engine == "vllm" \
            else []
        return start_gateway(tmp, "--upstream", ",".join(urls), *tuned)
    if gateway == "smg":
        port = free_port()
        args = [str(smg), "launch", "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-port", str(free_port()), "--worker-urls", *urls, *SMG_ARGS]
        return Server(args, port, "/readiness", tmp / f"smg-{port}.log")
    return None


def stop(server: Server) -> None:
    server.stop_timeout = 3.0  # clients still open: no need to wait them out
    server.stop()


# ---------------------------------------------------------------------- step 1: capacity
async def capacity(engines: list[Server], shape: Shape, probe_s: float, warm_s: float) -> float:
    """Requests/s the engines complete together with exactly their batches open."""
    t0 = time.monotonic()
    recs: list[Rec] = []
    counter = itertools.count(1)

    async def worker(port: int) -> None:
        while time.monotonic() - t0 < probe_s:
            rec = Rec(-next(counter), "api", shape.max_tokens, PROMPT_CHARS)
            recs.append(rec)
            await one(port, rec, shape.model, shape.client_timeout)

    await asyncio.gather(*(worker(e.port) for e in engines for _ in range(shape.slots)))
    done = [r for r in recs if r.outcome == "completed" and r.end is not None
            and t0 + warm_s <= r.end <= t0 + probe_s]
    return len(done) / (probe_s - warm_s)


# ---------------------------------------------------------------------- step 2: load
def arrivals(seed: int, factor: float, rate: float, load_s: float, mix: str,
             shape: Shape) -> list[tuple[float, Request]]:
    """The same Poisson arrivals (offset from the start, request) for every gateway."""
    rng = random.Random(f"{seed}-{factor:g}")
    names = [c for c, _ in MIXES[mix]]
    weights = [w for _, w in MIXES[mix]]
    out: list[tuple[float, Request]] = []
    at = 0.0
    while (at := at + rng.expovariate(rate)) < load_s:
        cls = rng.choices(names, weights)[0]
        out.append((at, Request(len(out), cls, shape.budgets[cls])))
    return out


async def attempt_all(req: Request, port: int, shape: Shape, rng: random.Random) -> None:
    """Send ``req``, and again after each refusal while the openai client would."""
    while True:
        rec = Rec(req.i, req.cls, shape.max_tokens, PROMPT_CHARS)
        req.attempts.append(rec)
        await one(port, rec, shape.model, shape.client_timeout)
        if not req.refused or len(req.attempts) > shape.retries:
            return
        delay = retry_delay(asked_delay(rec.retry_after_ms, rec.retry_after),
                            len(req.attempts) - 1, rng)
        if delay is None:
            return
        await asyncio.sleep(delay)


async def sample(ph: Phase, front: Server | None, engines: list[Server],
                 stopped: asyncio.Event) -> None:
    while not stopped.is_set():
        try:
            if front is not None and ph.gateway == "qosgate":
                m = await asyncio.to_thread(metrics, front.url)
                ph.queue.append(one_value(m, "qosgate_queue_depth"))
            waiting = running = 0.0
            for e in engines:
                m = await asyncio.to_thread(metrics, e.url)
                waiting += one_value(m, "vllm:num_requests_waiting")
                running += one_value(m, "vllm:num_requests_running")
            ph.waiting.append(waiting)
            ph.running.append(running)
        except OSError:
            pass
        await asyncio.sleep(SAMPLE_S)


async def drive(ph: Phase, plan: list[tuple[float, Request]], port_of: Callable[[int], int],
                front: Server | None, engines: list[Server], shape: Shape, seed: int) -> None:
    loop = asyncio.get_running_loop()
    jitter = random.Random(f"{seed}-{ph.factor:g}-jitter")
    stopped = asyncio.Event()
    sampler = loop.create_task(sample(ph, front, engines, stopped))
    tasks: list[asyncio.Task[None]] = []
    ph.t0 = time.monotonic()
    for at, req in plan:
        delay = ph.t0 + at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        ph.requests.append(req)
        tasks.append(loop.create_task(attempt_all(req, port_of(req.i), shape, jitter)))
    ph.load_s = max(time.monotonic() - ph.t0, plan[-1][0] if plan else 0.0)
    stopped.set()
    await sampler
    # every attempt ends by the client's time-out; every wait is at most MAX_RETRY_AFTER_S
    bound = (shape.retries + 1) * (shape.client_timeout + 5) + shape.retries * MAX_RETRY_AFTER_S
    _, pending = await asyncio.wait(tasks, timeout=bound) if tasks else (set(), set())
    for t in pending:
        t.cancel()


async def load_phase(gateway: str, factor: float, rate: float, plan: list[tuple[float, Request]],
                     tmp: Path, engines: list[Server], shape: Shape, seed: int,
                     smg: Path) -> Phase:
    ph = Phase(gateway, factor, rate)
    front = start_front(gateway, tmp, engines, shape, smg)
    ports = [front.port] if front is not None else [e.port for e in engines]
    try:
        await drive(ph, plan, lambda i: ports[i % len(ports)], front, engines, shape, seed)
    finally:
        if front is not None:
            stop(front)
        for e in engines:
            await asyncio.to_thread(vllm_common.drain, e)
    return ph


# ---------------------------------------------------------------------- main
async def main_async(args: argparse.Namespace) -> None:
    vllm = args.engine == "vllm"
    shape = Shape(args.engine, vllm_common.MODEL if vllm else STANDIN_MODEL,
                  VLLM_SEQS if vllm else STANDIN_SEQS, args.max_tokens, args.client_timeout,
                  args.retries, budgets())
    probe_s, warm_s = (10.0, 3.0) if args.quick else (30.0, 8.0) if vllm else (20.0, 5.0)
    gateways = args.gateways.split(",")
    loads = [float(x) for x in args.loads.split(",")]
    with tempfile.TemporaryDirectory(prefix="goodput-") as d:
        tmp = Path(d)
        engines = start_engines(args.engine, tmp, args.time_scale)
        try:
            what = (f"1 vLLM CPU engine ({vllm_common.MODEL}, --max-num-seqs {VLLM_SEQS}, "
                    "--scheduling-policy priority)" if vllm else
                    f"{STANDINS} stand-ins (--max-num-seqs {STANDIN_SEQS}, --time-scale "
                    f"{args.time_scale:g})")
            print(f"{what}; streaming, max_tokens {shape.max_tokens}, prompt {PROMPT_CHARS} "
                  f"chars; client time-out {shape.client_timeout:g} s; retries {shape.retries}; "
                  f"mix {args.mix}: " + ", ".join(
                      f"{c} {w * 100:.0f}% (TTFT <= {shape.budgets[c]:g} s)"
                      for c, w in MIXES[args.mix]), flush=True)
            if "smg" in gateways:
                print(f"smg: {args.smg} launch --worker-urls ... {' '.join(SMG_ARGS)}")
            cap = await capacity(engines, shape, probe_s, warm_s)
            for e in engines:
                await asyncio.to_thread(vllm_common.drain, e)
            print(f"capacity: {cap:.2f} req/s ({shape.slots} streams open per engine, "
                  f"{probe_s - warm_s:g} s after {warm_s:g} s of warm-up)", flush=True)
            phases = []
            for factor in loads:
                plan_args = (args.seed, factor, factor * cap, args.duration, args.mix, shape)
                for gw in gateways:
                    t = time.monotonic()
                    ph = await load_phase(gw, factor, factor * cap, arrivals(*plan_args), tmp,
                                          engines, shape, args.seed, args.smg)
                    print(f"{gw} at {factor:g}x: {len(ph.requests)} requests, "
                          f"{time.monotonic() - t:.0f} s", flush=True)
                    phases.append(ph)
        finally:
            for e in engines:
                e.stop()
    print_tables(phases, shape.retries > 0)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "engine": args.engine, "time_scale": args.time_scale, "mix": args.mix,
            "max_tokens": shape.max_tokens, "client_timeout_s": shape.client_timeout,
            "retries": shape.retries, "budgets_s": shape.budgets, "seed": args.seed,
            "smg_args": list(SMG_ARGS), "capacity_per_s": cap,
            "phases": [phase_json(p) for p in phases]}, indent=1))
        print(f"\nwrote {args.json}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true",
                   help="20 s of arrivals, a shorter probe; by default direct,qosgate at 1,3")
    p.add_argument("--gateways", help=f"comma-separated, from {', '.join(GATEWAYS)} "
                   "(default: all; --quick: direct,qosgate)")
    p.add_argument("--loads", help="load factors, comma-separated (default 1,2,3,5; "
                   "--quick or --engine vllm: 1,3)")
    p.add_argument("--duration", type=float, help="seconds of arrivals per phase (default 60; "
                   "--quick 20; --engine vllm 30)")
    p.add_argument("--mix", choices=sorted(MIXES), default="api")
    p.add_argument("--retries", type=int, default=0, help="resends of a refused request")
    p.add_argument("--client-timeout", type=float, default=30.0)
    p.add_argument("--max-tokens", type=int, help="default 64; --engine vllm 32")
    p.add_argument("--engine", choices=("standin", "vllm"), default="standin")
    p.add_argument("--time-scale", type=float, default=4.0, help="the stand-ins'")
    p.add_argument("--smg", type=Path, default=SMG, help="the smg command")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write every phase, its samples and requests here")
    args = p.parse_args(argv)
    vllm = args.engine == "vllm"
    small = args.quick or vllm
    args.gateways = args.gateways or ("direct,qosgate" if args.quick else ",".join(GATEWAYS))
    args.loads = args.loads or ("1,3" if small else "1,2,3,5")
    args.duration = args.duration or (20.0 if args.quick else 30.0 if vllm else 60.0)
    args.max_tokens = args.max_tokens or (32 if vllm else 64)
    unknown = [g for g in args.gateways.split(",") if g not in GATEWAYS]
    if unknown:
        p.error(f"unknown gateway(s) {unknown}; known: {', '.join(GATEWAYS)}")
    if "smg" in args.gateways.split(",") and not args.smg.exists():
        p.error(f"no smg at {args.smg}: python3 -m venv ~/.cache/qosgate/smg-1.13.0 && "
                "~/.cache/qosgate/smg-1.13.0/bin/pip install smg==1.13.0 (or --smg PATH)")
    uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
