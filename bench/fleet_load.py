"""Static windows vs adaptive ones on a mixed fleet: 3 stand-ins of different speeds behind the
gateway, mixed classes at ~1.5x the fleet's measured capacity.

    .venv/bin/python bench/fleet_load.py [--quick] [--load-factor 1.5] [--seed N]
        [--phases static,adaptive,spread,guard,spread-guard]

A benchmark, not a test: it prints what happened. Three steps, each on fresh processes:

1. **capacity**: the stand-ins driven directly (no gateway), each closed-loop with exactly
   ``--max-num-seqs`` streams open (its batch full, nothing queued inside it), for ``PROBE_S``;
   the tokens each generates per second after a warm-up, divided by the mix's mean output
   length and summed, are the fleet's capacity in requests/s for this mix;
2. **static**: ``fleet: {window: {mode: fixed}, router: most-free}``, every replica's window
   the configured capacity (``CAPACITY``, the upstream default), as before adaptive windows;
3. **adaptive**: ``fleet: {window: {mode: adaptive}, router: least-load}`` (the defaults);
   with ``--phases``, also **spread** (that, with the opt-in ``router: least-load-spread``),
   **guard** (the defaults with the opt-in ``tpot_guard: auto``) and **spread-guard** (both).

Every load phase sends the same open-loop Poisson load (same seed) at ``--load-factor`` x the
capacity for ``LOAD_S``, all streaming, the class mix of ``bench/fleet_faults.py`` (30%
realtime, 30% api, 20% batch, 20% offline, class-typical prompt and output lengths), then
wait at most ``DRAIN_S`` for the rest; what is still open then is counted as such and
abandoned (the client disconnects).

The stand-ins run a copy of the default (H100) profile with a small batch and KV cache
(``--max-num-seqs`` 16, ``KV_TOKENS`` KV tokens: long prompts can fill it, so an engine that
is handed too much preempts), ``--time-scale`` 8 and ``--slow`` 1, 2 and 4: r0 is four times
as fast as r2. Sampled every ``SAMPLE_S`` during the load: the gateway's
``qosgate_replica_capacity`` (the window in force) and ``qosgate_queue_depth``, and each
stand-in's ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc``; at the end each
stand-in's ``vllm:num_preemptions_total`` and ``vllm:request_success_total``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the one server-process wrapper lives with the tests

import uvloop  # noqa: E402
import yaml  # noqa: E402

from bench.fleet_faults import (  # noqa: E402
    CLASSES,
    Rec,
    markers,
    metrics,
    new_request,
    one,
    one_value,
    pct,
)
from qosgate import config as qconfig  # noqa: E402
from qosgate.models.simmodel import load_profile  # noqa: E402
from tests.support.processes import Server, start_gateway, start_standin  # noqa: E402

SLOW = (1.0, 2.0, 4.0)  # r0, r1, r2
TIME_SCALE = 8.0
MAX_NUM_SEQS = 16
KV_TOKENS = 8192
CAPACITY = 64  # the upstream default: the static window
PROBE_S, PROBE_WARM_S = 24.0, 6.0
LOAD_S, DRAIN_S = 60.0, 20.0
SAMPLE_S = 0.5
NAMES = [c[0] for c in CLASSES]


# ---------------------------------------------------------------------- processes
def write_profile(tmp: Path) -> Path:
    prof = load_profile("default").model_dump()
    prof.update(name="bench-fleet-load", max_num_seqs=MAX_NUM_SEQS, kv_capacity_tokens=KV_TOKENS)
    path = tmp / "profile.yaml"
    path.write_text(yaml.safe_dump(prof))
    return path


def standins(tmp: Path, profile: Path, record: str = "") -> list[Server]:
    out = []
    for k, slow in enumerate(SLOW):
        args = ["--scheduling-policy", "priority", "--profile", str(profile),
                "--time-scale", str(TIME_SCALE)]
        if record:
            args += ["--record", str(tmp / f"{record}-r{k}.jsonl")]
        if slow != 1.0:
            args += ["--slow", str(slow)]
        out.append(start_standin(tmp, *args))
    return out


def stop_all(servers: list[Server]) -> None:
    for s in servers:
        s.stop()


# each phase's fleet section: static (before adaptive windows), adaptive (the defaults), and the
# opt-in router and TPOT guard on top of the defaults (docs/guides/fleet.md,
# docs/experiments/tpot-guard.md)
PHASES: dict[str, dict[str, Any]] = {
    "static": {"window": {"mode": "fixed"}, "router": "most-free"},
    "adaptive": {"window": {"mode": "adaptive"}, "router": "least-load"},
    "spread": {"window": {"mode": "adaptive"}, "router": "least-load-spread"},
    "guard": {"window": {"mode": "adaptive"}, "router": "least-load", "tpot_guard": "auto"},
    "spread-guard": {"window": {"mode": "adaptive"}, "router": "least-load-spread",
                     "tpot_guard": "auto"},
}


def gateway(tmp: Path, urls: list[str], mode: str) -> Server:
    fleet = PHASES[mode]
    cfg = {
        "classes": [c.model_dump(exclude_none=True) for c in qconfig.default_config().classes],
        "upstreams": [{"url": u, "name": f"r{i}", "max_window": CAPACITY,
                       "priority_polarity": "vllm"} for i, u in enumerate(urls)],
        "fleet": fleet,
    }
    path = tmp / f"gateway-{mode}.json"
    path.write_text(json.dumps(cfg, indent=1))
    return start_gateway(tmp, "--config", str(path))


# ---------------------------------------------------------------------- step 1: capacity
async def probe(urls: list[str], rng: random.Random, duration: float,
                warm: float) -> list[float]:
    """Requests/s each stand-in sustains alone with exactly its batch of streams open: the
    tokens it generates per second after the warm-up (``vllm:generation_tokens_total``)
    divided by the mix's mean output length (a slow replica finishes too few requests in a
    short probe to count them)."""
    t0 = time.monotonic()
    counter = iter(range(10**9))

    async def worker(port: int) -> None:
        while time.monotonic() - t0 < duration:
            await one(port, new_request(rng, -next(counter) - 1))

    async def tokens() -> list[float]:
        out = []
        for u in urls:
            m = await asyncio.to_thread(metrics, u)
            out.append(one_value(m, "vllm:generation_tokens_total"))
        return out

    ports = [int(u.rsplit(":", 1)[1]) for u in urls]
    workers = [asyncio.create_task(worker(p)) for p in ports for _ in range(MAX_NUM_SEQS)]
    await asyncio.sleep(warm)
    a, ta = await tokens(), time.monotonic()
    await asyncio.sleep(max(0.0, t0 + duration - time.monotonic()))
    b, tb = await tokens(), time.monotonic()
    for w in workers:
        w.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    mean_out = sum(w * (lo + hi) / 2 for _, w, (lo, hi), _ in CLASSES)
    return [(y - x) / (tb - ta) / mean_out for x, y in zip(a, b, strict=True)]


# ---------------------------------------------------------------------- steps 2, 3: load
@dataclass
class Phase:
    mode: str
    recs: list[Rec] = field(default_factory=list)
    load_s: float = 0.0
    windows: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    queue: list[float] = field(default_factory=list)
    waiting: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    kv: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    preemptions: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    placed: dict[int, str] = field(default_factory=dict)  # request -> the replica it reached


async def load_phase(mode: str, tmp: Path, profile: Path, rate: float, seed: int,
                     load_s: float, drain_s: float) -> Phase:
    sis = standins(tmp, profile, record=mode)
    urls = [s.url for s in sis]
    gw = gateway(tmp, urls, mode)
    ph = Phase(mode)
    try:
        await _drive(ph, gw, sis, rate, seed, load_s, drain_s)
        for k, s in enumerate(sis):
            m = await asyncio.to_thread(metrics, s.url)
            ph.preemptions[f"r{k}"] = one_value(m, "vllm:num_preemptions_total")
            ph.finished[f"r{k}"] = one_value(m, "vllm:request_success_total")
    finally:
        gw.stop_timeout = 3.0  # clients still open after the drain: no need to wait them out
        gw.stop()
        stop_all(sis)
    for k in range(len(sis)):
        for i in markers(tmp / f"{mode}-r{k}.jsonl"):
            ph.placed[i] = "several" if i in ph.placed else f"r{k}"
    return ph


async def _drive(ph: Phase, gw: Server, sis: list[Server], rate: float, seed: int,
                 load_s: float, drain_s: float) -> None:
    loop = asyncio.get_running_loop()
    rng = random.Random(seed)
    tasks: list[asyncio.Task[None]] = []
    stop_sampling = asyncio.Event()

    async def sample() -> None:
        while not stop_sampling.is_set():
            try:
                m = await asyncio.to_thread(metrics, gw.url)
                for k in range(len(sis)):
                    ph.windows[f"r{k}"].append(
                        one_value(m, "qosgate_replica_capacity", replica=f"r{k}"))
                ph.queue.append(one_value(m, "qosgate_queue_depth"))
                for k, s in enumerate(sis):
                    e = await asyncio.to_thread(metrics, s.url)
                    ph.waiting[f"r{k}"].append(one_value(e, "vllm:num_requests_waiting"))
                    ph.kv[f"r{k}"].append(one_value(e, "vllm:kv_cache_usage_perc"))
            except OSError:
                pass
            await asyncio.sleep(SAMPLE_S)

    sampler = loop.create_task(sample())
    t0 = time.monotonic()
    next_at = t0
    i = 0
    while True:
        next_at += rng.expovariate(rate)
        if next_at - t0 >= load_s:
            break
        delay = next_at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = new_request(rng, i)
        i += 1
        ph.recs.append(rec)
        tasks.append(loop.create_task(one(gw.port, rec)))
    ph.load_s = time.monotonic() - t0
    stop_sampling.set()
    await sampler
    _, pending = await asyncio.wait(tasks, timeout=drain_s)
    for t in pending:
        t.cancel()
    for r in ph.recs:
        r.sent -= t0
        r.first = None if r.first is None else r.first - t0
        r.end = None if r.end is None else r.end - t0


# ---------------------------------------------------------------------- report
def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f}"


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def report(phases: list[Phase]) -> None:
    print()
    print(f"{'':<34}" + "".join(f"{p.mode:>16}" for p in phases))

    def row(label: str, vals: list[str]) -> None:
        print(f"{label:<34}" + "".join(f"{v:>16}" for v in vals))

    rt = [[r.first - r.sent for r in p.recs if r.cls == "realtime" and r.first is not None
           and r.outcome == "completed"] for p in phases]
    row("realtime TTFT p50 ms", [_ms(pct(x, 50)) for x in rt])
    row("realtime TTFT p99 ms", [_ms(pct(x, 99)) for x in rt])
    row("realtime TTFT max ms", [_ms(max(x) if x else None) for x in rt])
    for rep in ("r0", "r1", "r2"):
        xs = [[r.first - r.sent for r in p.recs if r.cls == "realtime" and r.first is not None
               and r.outcome == "completed" and p.placed.get(r.i) == rep] for p in phases]
        row(f"  at {rep}: n, p50 / p99 ms",
            [f"{len(x)}, {_ms(pct(x, 50))} / {_ms(pct(x, 99))}" for x in xs])
    row("requests sent", [str(len(p.recs)) for p in phases])
    for cls in NAMES:
        print(f"  {cls}")
        recs = [[r for r in p.recs if r.cls == cls] for p in phases]
        done = [[r for r in rs if r.outcome == "completed"] for rs in recs]
        row("    sent", [str(len(rs)) for rs in recs])
        row("    completed", [str(len(d)) for d in done])
        row("    refused at arrival (429/503)",
            [str(sum(r.outcome.startswith(("http_429", "http_503")) for r in rs)) for rs in recs])
        row("    timed out / failed",
            [str(sum(r.outcome not in ("completed", "unresolved")
                     and not r.outcome.startswith(("http_429", "http_503")) for r in rs))
             for rs in recs])
        codes = [Counter(r.outcome for r in rs if r.outcome not in ("completed", "unresolved"))
                 for rs in recs]
        if any(codes):
            print("      not completed: " + "; ".join(
                f"{p.mode} " + (", ".join(f"{k} {v}" for k, v in sorted(c.items())) or "none")
                for p, c in zip(phases, codes, strict=True)))
        row("    still open after the drain", [str(sum(r.outcome == "unresolved" for r in rs))
                                               for rs in recs])
        row("    done/s during the load",
            [f"{sum(r.end is not None and r.end <= p.load_s for r in d) / p.load_s:.2f}"
             for p, d in zip(phases, done, strict=True)])
        row("    TTFT p50 / p99 s",
            [f"{(pct(x, 50) or 0):.1f} / {(pct(x, 99) or 0):.1f}" for x in
             [[r.first - r.sent for r in d if r.first is not None] for d in done]])
    row("output tokens/s during the load",
        [f"{sum(r.max_tokens for r in p.recs if r.outcome == 'completed' and r.end is not None and r.end <= p.load_s) / p.load_s:.0f}"  # noqa: E501
         for p in phases])
    row("gateway queue depth mean / max",
        [f"{_mean(p.queue):.0f} / {max(p.queue, default=0):.0f}" for p in phases])
    for rep in sorted(phases[0].finished):
        print(f"  {rep} (x{SLOW[int(rep[1:])]:g} slower)")
        row("    window start / end", [
            f"{p.windows[rep][0]:.0f} / {p.windows[rep][-1]:.0f}" if p.windows[rep] else "-"
            for p in phases])
        row("    window mean (min-max)", [
            f"{_mean(p.windows[rep]):.1f} ({min(p.windows[rep]):.0f}-{max(p.windows[rep]):.0f})"
            if p.windows[rep] else "-" for p in phases])
        row("    engine waiting mean / max",
            [f"{_mean(p.waiting[rep]):.1f} / {max(p.waiting[rep], default=0):.0f}"
             for p in phases])
        row("    engine KV use mean", [f"{_mean(p.kv[rep]):.2f}" for p in phases])
        row("    engine preemptions", [f"{p.preemptions[rep]:.0f}" for p in phases])
        row("    requests it finished", [f"{p.finished[rep]:.0f}" for p in phases])


async def main_async(args: argparse.Namespace) -> None:
    scale = 0.5 if args.quick else 1.0
    with tempfile.TemporaryDirectory(prefix="fleet_load-") as d:
        tmp = Path(d)
        profile = write_profile(tmp)
        print(f"3 stand-ins: default profile with max_num_seqs {MAX_NUM_SEQS}, KV "
              f"{KV_TOKENS} tokens, --time-scale {TIME_SCALE:g}, --slow "
              + "/".join(f"{s:g}" for s in SLOW) + " (r0/r1/r2), --scheduling-policy priority")
        print("mix: all streaming, " + ", ".join(
            f"{n} {int(w * 100)}% ({lo}-{hi} tokens, {plo}-{phi} prompt chars)"
            for n, w, (lo, hi), (plo, phi) in CLASSES), flush=True)
        sis = standins(tmp, profile)
        try:
            per = await probe([s.url for s in sis], random.Random(args.seed + 1),
                              PROBE_S * scale, PROBE_WARM_S * scale)
        finally:
            stop_all(sis)
        cap = sum(per)
        rate = args.load_factor * cap
        print(f"capacity (stand-ins driven directly, {MAX_NUM_SEQS} streams open each, "
              f"{PROBE_S * scale:g} s, generated tokens/s / mean output length): "
              + ", ".join(f"r{k} {v:.2f}" for k, v in enumerate(per))
              + f" = {cap:.2f} req/s; load {args.load_factor:g}x = {rate:.2f} req/s Poisson for "
              f"{LOAD_S * scale:g} s, then at most {DRAIN_S * scale:g} s of drain", flush=True)
        phases = []
        for mode in args.phases.split(","):
            t = time.monotonic()
            ph = await load_phase(mode, tmp, profile, rate, args.seed, LOAD_S * scale,
                                  DRAIN_S * scale)
            print(f"{mode}: fleet {json.dumps(PHASES[mode])}, window max {CAPACITY}; "
                  f"{len(ph.recs)} requests, {time.monotonic() - t:.0f} s", flush=True)
            phases.append(ph)
        report(phases)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="half the durations")
    p.add_argument("--load-factor", type=float, default=1.5)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--phases", default="static,adaptive",
                   help=f"comma-separated, from {', '.join(PHASES)}")
    args = p.parse_args(argv)
    unknown = [m for m in args.phases.split(",") if m not in PHASES]
    if unknown:
        p.error(f"unknown phase(s) {unknown}; known: {', '.join(PHASES)}")
    uvloop.run(main_async(args))


if __name__ == "__main__":
    main()
