"""Does a heavy model's batch flood hurt a light model's realtime? One qosgate in front of a
light and a heavy model's engines (stand-ins), real processes.

    .venv/bin/python bench/models_isolation.py [--quick] [--variants shared,shared-cost,pools]
        [--duration 40] [--rate 4] [--flood 48] [--light-class realtime] [--seed N]

A benchmark, not a test: it prints what happened. ``--quick``: 20 s of arrivals per variant.

Engines: a light stand-in (``--served-model-name light``) and a heavy one (``heavy``, the same
profile with ``--slow 10``: every step ten times as long), ``--max-num-seqs`` 8 each. A vLLM
process serves one model, so a replica that serves both is an upstream that is itself a router
in front of both engines (an llm-d or SMG, say); here that router is a second qosgate
(``--policy fifo``, plain routing by model). Variants, each a fresh set of processes:

- ``shared``: qosgate's one upstream is that router, declared as serving both models, with a
  fixed window of ``SHARED_WINDOW`` requests and no model weights: what a user gets without
  ``models:`` (the window counts requests, whichever model they are of);
- ``shared-cost``: the same, with ``models:`` giving the heavy model weight ten: its requests
  hold ten slots each of that window (``core.slot_costs``), sized in slots of the light model:
  ``SHARED_WINDOW`` for the light engine plus ten for each of the heavy engine's sequences;
- ``pools``: the two engines as qosgate's own upstreams (a pool per model), with the weights;
- ``pools-divided`` (opt-in): the same, with the heavy pool's window divided by its weight (one
  request): whether a heavy model's own replica wants a window sized by its cost.

Traffic, the same in every variant (same seed): ``--light-class`` requests (realtime by default)
on the light model, Poisson at ``--rate`` per second, 16 output tokens; and ``--flood`` clients
each sending heavy batch requests (32 output tokens) back to back, for ``--duration`` seconds.
Printed per variant: the light requests' TTFT p50 / p99, their share on time (within their
class's TTFT budget, qosgate's default: realtime 1 s, api 5 s), refusals, and the heavy batch's
completions per second; then each against ``shared``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the one server-process wrapper lives with the tests

from bench.fleet_faults import Rec, one  # noqa: E402
from bench.goodput import stop  # noqa: E402
from qosgate import config as qconfig  # noqa: E402
from tests.support.processes import Server, start_gateway, start_standin  # noqa: E402

LIGHT, HEAVY = "light", "heavy"
SLOW = 10  # the heavy engine's steps take this many times the light one's
SEQS = 8  # each engine's --max-num-seqs
SHARED_WINDOW = 16  # the shared upstream's window, in requests (two engines of SEQS)
VARIANTS = ("shared", "shared-cost", "pools")
OPT_IN = ("pools-divided",)
LIGHT_TOKENS, HEAVY_TOKENS = 16, 32
PROMPT_CHARS = 200
TIME_SCALE = 2.0  # the stand-ins' modelled time, slowed down: fewer events for this machine


@dataclass
class Outcome:
    variant: str
    light: list[Rec]
    heavy: list[Rec]
    start: float  # when the arrivals began (monotonic)
    seconds: float  # how long they ran


def front_config(variant: str, engines: dict[str, str], router: str | None) -> dict[str, Any]:
    """The front qosgate's config for ``variant``: the default classes, a fixed window."""
    cfg: dict[str, Any] = {
        "classes": [c.model_dump(exclude_none=True) for c in qconfig.default_config().classes],
        "fleet": {"window": {"mode": "fixed"}},
    }
    if variant != "shared":
        cfg["models"] = [{"name": LIGHT}, {"name": HEAVY, "weight": float(SLOW)}]
    if variant.startswith("pools"):
        divided = variant == "pools-divided"
        cfg["upstreams"] = [
            {"url": url, "name": model, "models": [model], "priority_polarity": "vllm",
             "max_window": max(1, SEQS // SLOW) if divided and model == HEAVY else SEQS}
            for model, url in engines.items()]
    else:
        window = SHARED_WINDOW if variant == "shared" else SEQS + SLOW * SEQS
        cfg["upstreams"] = [{"url": router, "name": "router", "models": [LIGHT, HEAVY],
                             "max_window": window, "scrape_metrics": False}]
    return cfg


def start(variant: str, tmp: Path) -> list[Server]:
    """The engines, the router (shared variants) and the front gateway, front last."""
    light = start_standin(tmp, "--served-model-name", LIGHT, "--max-num-seqs", str(SEQS),
                          "--time-scale", str(TIME_SCALE))
    heavy = start_standin(tmp, "--served-model-name", HEAVY, "--max-num-seqs", str(SEQS),
                          "--time-scale", str(TIME_SCALE), "--slow", str(SLOW))
    servers = [light, heavy]
    router = None
    if not variant.startswith("pools"):
        inner = start_gateway(tmp, "--upstream", f"{light.url},{heavy.url}", "--policy", "fifo",
                              "--max-window", str(SEQS))
        servers.append(inner)
        router = inner.url
    path = tmp / f"front-{variant}.json"
    path.write_text(json.dumps(front_config(variant, {LIGHT: light.url, HEAVY: heavy.url},
                                            router), indent=1))
    servers.append(start_gateway(tmp, "--config", str(path)))
    return servers


async def drive(port: int, light_class: str, rate: float, flood: int, duration: float,
                seed: int) -> tuple[list[Rec], list[Rec]]:
    rng = random.Random(seed)
    light: list[Rec] = []
    heavy: list[Rec] = []
    t0 = time.monotonic()
    tasks: list[asyncio.Task[None]] = []
    floods: list[asyncio.Task[None]] = []

    async def flooder(k: int) -> None:
        n = 0
        while time.monotonic() - t0 < duration:
            rec = Rec(1_000_000 * (k + 1) + n, "batch", HEAVY_TOKENS, PROMPT_CHARS)
            heavy.append(rec)
            await one(port, rec, HEAVY, timeout=120.0)
            n += 1

    def spawn(coro: Coroutine[Any, Any, None]) -> None:
        tasks.append(asyncio.create_task(coro))

    for k in range(flood):
        floods.append(asyncio.create_task(flooder(k)))
    at, i = 0.0, 0
    while True:
        at += rng.expovariate(rate)
        if at >= duration:
            break
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        rec = Rec(i, light_class, LIGHT_TOKENS, PROMPT_CHARS)
        light.append(rec)
        spawn(one(port, rec, LIGHT, timeout=60.0))
        i += 1
    await asyncio.gather(*tasks)
    # the heavy requests still out when the light ones are done are left (closed): their
    # throughput counts what completed within the run
    for task in floods:
        task.cancel()
    await asyncio.gather(*floods, return_exceptions=True)
    return light, heavy


def quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def row(o: Outcome, budget_s: float) -> dict[str, float]:
    ttft = [r.first - r.sent for r in o.light if r.outcome == "completed" and r.first]
    on_time = sum(1 for t in ttft if t <= budget_s)
    refused = sum(1 for r in o.light if r.outcome.startswith("http_"))
    done = [r for r in o.heavy if r.outcome == "completed" and r.end is not None
            and r.end - o.start <= o.seconds]
    heavy_refused = sum(1 for r in o.heavy if r.outcome.startswith("http_"))
    return {"sent": len(o.light), "p50": quantile(ttft, 0.5), "p99": quantile(ttft, 0.99),
            "on_time": on_time / len(o.light) if o.light else float("nan"),
            "refused": refused, "heavy_per_s": len(done) / o.seconds,
            "heavy_refused": heavy_refused}


def _ends(recs: list[Rec]) -> str:
    counts = Counter(r.outcome for r in recs)
    return ", ".join(f"{k} {v}" for k, v in counts.most_common())


def report(outcomes: list[Outcome], light_class: str) -> None:
    budget_s = next(c.ttft_budget_ms / 1000 for c in qconfig.default_config().classes
                    if c.name == light_class)
    rows = {o.variant: row(o, budget_s) for o in outcomes}
    print(f"\nlight model, class {light_class} (TTFT budget {budget_s:g} s); heavy batch flood")
    print(f"{'variant':<12} {'sent':>5} {'TTFT p50 s':>10} {'TTFT p99 s':>10} {'on time':>8} "
          f"{'refused':>7} {'heavy done/s':>12} {'heavy refused':>13}")
    for name, r in rows.items():
        print(f"{name:<12} {r['sent']:>5} {r['p50']:>10.3f} {r['p99']:>10.3f} "
              f"{r['on_time']:>8.1%} {r['refused']:>7} {r['heavy_per_s']:>12.2f} "
              f"{r['heavy_refused']:>13}")
    print("\nhow the requests ended (light | heavy)")
    for o in outcomes:
        print(f"{o.variant:<12} {_ends(o.light)} | {_ends(o.heavy)}")
    base = rows.get("shared")
    if base is None:
        return
    print("\nagainst shared (x its value)")
    print(f"{'variant':<12} {'TTFT p50':>9} {'TTFT p99':>9} {'on time':>8} {'heavy done/s':>12}")
    for name, r in rows.items():
        print(f"{name:<12} {r['p50'] / base['p50']:>9.2f} {r['p99'] / base['p99']:>9.2f} "
              f"{r['on_time'] / base['on_time']:>8.2f} "
              f"{r['heavy_per_s'] / base['heavy_per_s']:>12.2f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="20 s of arrivals per variant")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--rate", type=float, default=4.0, help="light requests per second")
    p.add_argument("--flood", type=int, default=48, help="heavy batch clients, back to back")
    p.add_argument("--light-class", default="realtime")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    duration = 20.0 if args.quick else args.duration
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(VARIANTS) - set(OPT_IN)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)} (known: {', '.join(VARIANTS + OPT_IN)})")
    outcomes = []
    for variant in variants:
        with tempfile.TemporaryDirectory() as tmp:
            servers = start(variant, Path(tmp))
            try:
                t0 = time.monotonic()
                light, heavy = asyncio.run(drive(servers[-1].port, args.light_class, args.rate,
                                                 args.flood, duration, args.seed))
                took = time.monotonic() - t0
                outcomes.append(Outcome(variant, light, heavy, t0, duration))
                print(f"{variant}: {len(light)} light, {len(heavy)} heavy sent, {took:.0f} s",
                      flush=True)
            finally:
                for server in reversed(servers):
                    stop(server)
    report(outcomes, args.light_class)


if __name__ == "__main__":
    main()
