"""Benchmark: scheduler operations per second at 1k, 10k and 100k queued requests.

One *cycle* is what a saturated gateway does per request: submit a new request (classify, admit,
enqueue), complete an in-flight one, pick + dispatch the next into the freed slot, and record that
request's first token. The queue
depth stays constant through the run. Beside it, in the same run, a raw ``heapq`` push+pop baseline
at the same depth, and the cost of cancelling a queued request at 1k vs 100k queued.

Times are the process's own CPU time (``time.process_time``), not wall time: the core is single
threaded, and on a shared machine wall time also counts the moments another process had the core.
Each cell is the best of ``--repeat`` runs (as ``timeit`` does); the heapq baseline likewise.

Targets: >= 50,000 cycles/s at 100k queued; cancel at 100k within 3x its cost at 1k.

    python bench/core_ops.py [--policies qos,fifo,...] [--sizes 1000,10000,100000] [--cycles N]
                             [--repeat R]
"""

from __future__ import annotations

import argparse
import gc
import heapq
import random
import time
from collections.abc import Callable

from qosgate.config import Admission, Tenant, default_config
from qosgate.core import POLICY_NAMES, Dispatch, QosInputs, ReplicaSpec, Scheduler

CLASSES = ("realtime", "api", "batch", "offline")
CLASS_MIX = (0.1, 0.3, 0.3, 0.3)
TENANTS = 20
CAPACITY = 64


def _scheduler(policy: str, depth: int) -> Scheduler:
    cfg = default_config(
        tenants=tuple(Tenant(name=f"t{i}", api_keys=(f"k{i}",)) for i in range(TENANTS)),
        admission=Admission(max_queue_total=depth * 4),
    )
    # nothing is refused (caps far above the depth, no deadline admission): this measures the
    # queue and dispatch, not admission control
    # (nor held back: no reserved share, no prefill budget, so the depth stays fixed)
    classes = tuple(
        c.model_copy(update={"max_queue": depth * 4, "deadline_admission": False,
                             "admission_wait_s": 1e9, "reserved_share": 0.0})
        for c in cfg.classes
    )
    fleet = cfg.fleet.model_copy(update={"prefill_budget_tokens": None})
    cfg = cfg.model_copy(update={"classes": classes, "fleet": fleet})
    return Scheduler(cfg, policy, [ReplicaSpec("r0", CAPACITY, window_mode="fixed")])


def _inputs(rng: random.Random, n: int) -> list[QosInputs]:
    classes = rng.choices(CLASSES, CLASS_MIX, k=n)
    return [QosInputs(api_key=f"k{rng.randrange(TENANTS)}", qos_class=c) for c in classes]


def prepare_cycles(policy: str, depth: int, cycles: int, seed: int = 1) -> Callable[[int], None]:
    """A scheduler at ``depth`` queued and inputs for ``cycles`` cycles; returns ``run(n)``, which
    runs the next ``n`` of those cycles (what ``bench_cycles`` times, and what
    ``core_callgrind.py`` counts instructions of)."""
    rng = random.Random(seed)
    s = _scheduler(policy, depth)
    now = 0.0
    pre = _inputs(rng, depth + CAPACITY)
    inflight: list[str] = []
    for i, q in enumerate(pre):
        req = s.make_request(f"p{i}", q, now, rng.randint(50, 2000), 256)
        for d in s.submit(req, now):
            if isinstance(d, Dispatch):
                inflight.append(d.req.id)
                s.first_token(d.req.id, now)
    assert s.queued_total == depth, (s.queued_total, depth)
    work = _inputs(rng, cycles)
    prompts = [rng.randint(50, 2000) for _ in range(cycles)]
    outputs = [rng.randint(1, 256) for _ in range(cycles)]
    done = 0

    def run(n: int) -> None:
        nonlocal now, done
        for i in range(done, done + n):
            now += 0.0001
            s.submit(s.make_request(f"c{i}", work[i], now, prompts[i], 256), now)
            rid = inflight[i]
            for d in s.complete(rid, now, outputs[i]):
                if isinstance(d, Dispatch):
                    inflight.append(d.req.id)
                    s.first_token(d.req.id, now)
        done += n
        assert s.queued_total == depth

    return run


def bench_cycles(policy: str, depth: int, cycles: int, seed: int = 1) -> float:
    run = prepare_cycles(policy, depth, cycles, seed)
    gc.collect()
    gc.disable()
    t0 = time.process_time()
    run(cycles)
    elapsed = time.process_time() - t0
    gc.enable()
    return cycles / elapsed


def bench_heapq(depth: int, cycles: int, seed: int = 1) -> float:
    rng = random.Random(seed)
    heap = [(rng.random(), i) for i in range(depth)]
    heapq.heapify(heap)
    keys = [rng.random() for _ in range(cycles)]
    gc.collect()
    t0 = time.process_time()
    for i in range(cycles):
        heapq.heappush(heap, (keys[i], i))
        heapq.heappop(heap)
    return cycles / (time.process_time() - t0)


def bench_cancel(policy: str, depth: int, cancels: int, seed: int = 2) -> float:
    """Microseconds per cancel of a random queued request, depth kept by re-submitting."""
    rng = random.Random(seed)
    s = _scheduler(policy, depth)
    now = 0.0
    for i, q in enumerate(_inputs(rng, depth + CAPACITY)):
        s.submit(s.make_request(f"p{i}", q, now, 100, 64), now)
    queued = [rid for bucket in s.queued for rid in bucket]
    victims = rng.sample(queued, cancels)
    refill = _inputs(rng, cancels)
    spent = 0.0
    gc.collect()
    gc.disable()
    for i, rid in enumerate(victims):
        t0 = time.process_time()
        s.cancel(rid, now)
        spent += time.process_time() - t0
        s.submit(s.make_request(f"n{i}", refill[i], now, 100, 64), now)
    gc.enable()
    assert s.queued_total == depth
    return spent / cancels * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--cycles", type=int, default=100_000)
    ap.add_argument("--cancels", type=int, default=500)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    policies = args.policies.split(",")
    sizes = [int(x) for x in args.sizes.split(",")]

    print(
        f"cycles per CPU-second (submit + complete + pick/dispatch + first token), "
        f"{args.cycles:,} per run, best of {args.repeat}"
    )
    print(
        f"{TENANTS} tenants, class mix {dict(zip(CLASSES, CLASS_MIX, strict=True))}, "
        f"{CAPACITY} slots"
    )
    header = f"{'queued':>8} | {'heapq push+pop':>15} | " + " | ".join(f"{p:>9}" for p in policies)
    print(header)
    print("-" * len(header))
    results: dict[tuple[str, int], float] = {}
    for depth in sizes:
        base = max(bench_heapq(depth, args.cycles) for _ in range(args.repeat))
        row = []
        for p in policies:
            results[(p, depth)] = max(
                bench_cycles(p, depth, args.cycles, seed=r) for r in range(args.repeat)
            )
            row.append(f"{results[(p, depth)]:>9,.0f}")
        print(f"{depth:>8,} | {base:>15,.0f} | " + " | ".join(row))

    lo, hi = min(sizes), max(sizes)
    print()
    print(
        f"cancel cost (us per cancel of a random queued request), {args.cancels} cancels, "
        f"best of {args.repeat}"
    )
    print(f"{'policy':>9} | {f'{lo:,} queued':>12} | {f'{hi:,} queued':>13} | ratio")
    for p in policies:
        a = min(bench_cancel(p, lo, min(args.cancels, lo // 2), r) for r in range(args.repeat))
        b = min(bench_cancel(p, hi, args.cancels, r) for r in range(args.repeat))
        print(f"{p:>9} | {a:>12.2f} | {b:>13.2f} | {b / a:.2f}x")

    print()
    for p in policies:
        rate = results[(p, hi)]
        verdict = "meets" if rate >= 50_000 else "MISSES"
        print(f"target >= 50,000 cycles/s at {hi:,} queued, {p}: {rate:,.0f} ({verdict})")


if __name__ == "__main__":
    main()
