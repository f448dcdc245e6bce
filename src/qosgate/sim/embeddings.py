"""An embeddings workload in virtual time: the linger controllers compared with the same
code that serves ``/v1/embeddings`` in the gateway.

Poisson arrivals of single-input requests (seeded; a share of them realtime) go through the
core ``Scheduler`` (admission, classes, dispatch to a replica) and the replica's ``Batcher``
(``core/batching.py``, the very object the gateway's runtime drives); a released batch runs on a
modelled engine whose call costs a fixed overhead plus a per-token time, ``parallel`` calls at
once (1: one accelerator that serves one batch at a time). A discrete-event loop stands in for
the runtime: the batcher's deadline is its one timer, a batch's end is an event.

``qosgate simulate-embeddings`` runs every linger setting (off, fixed ones, adaptive) at every
rate and prints one table; nothing here reads a clock.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from qosgate.config import QosConfig, default_config
from qosgate.core import Dispatch, Finished, QosInputs, ReplicaSpec, Scheduler
from qosgate.core.batching import Batch, Batcher, BatchLimits, LingerController, make_controller

REPLICA = "embed-0"


@dataclass(frozen=True, slots=True)
class EmbedWorkload:
    rate: float  # arrivals per second
    seconds: float = 30.0
    seed: int = 1
    realtime_share: float = 0.0
    tokens: tuple[int, int] = (8, 16)  # per request, uniform
    overhead_s: float = 0.020  # per engine call (a batch)
    token_s: float = 50e-6  # per token in the batch
    parallel: int = 1  # engine calls served at once (the rest wait at the engine)


@dataclass(slots=True)
class EmbedResult:
    name: str
    rate: float
    completed: int = 0
    sent: int = 0
    span_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    rt_latencies: list[float] = field(default_factory=list)
    batches: int = 0
    batched: int = 0
    linger_s: float = 0.0
    decisions: dict[str, int] = field(default_factory=dict)

    @property
    def throughput(self) -> float:
        return self.completed / self.span_s if self.span_s > 0 else 0.0

    @property
    def mean_batch(self) -> float:
        return self.batched / self.batches if self.batches else 0.0

    def pct(self, q: float, realtime: bool = False) -> float:
        xs = sorted(self.rt_latencies if realtime else self.latencies)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def simulate_embeddings(
    wl: EmbedWorkload,
    controller: LingerController,
    limits: BatchLimits,
    name: str = "",
    cfg: QosConfig | None = None,
) -> EmbedResult:
    cfg = cfg or default_config()
    sched = Scheduler(cfg, None, [ReplicaSpec(REPLICA, 64, False, window_mode="fixed")])
    batcher = Batcher(limits, controller)
    rng = random.Random(wl.seed)
    res = EmbedResult(name, wl.rate)
    seq = itertools.count()
    # events: (time, order, kind, payload)
    events: list[tuple[float, int, str, object]] = []
    t = 0.0
    while True:
        t += rng.expovariate(wl.rate)
        if t >= wl.seconds:
            break
        rt = rng.random() < wl.realtime_share
        heapq.heappush(events, (t, next(seq), "arrive", (rt, rng.randint(*wl.tokens))))
    arrived: dict[str, float] = {}
    tokens_of: dict[str, int] = {}
    realtime: set[str] = set()
    busy_until: list[float] = [0.0] * max(1, wl.parallel)  # the engine's call slots
    ids = itertools.count(1)
    timer_at: float | None = None

    def apply(decisions: list[object], now: float) -> None:
        for d in decisions:
            if isinstance(d, Dispatch):
                rid = d.req.id
                batcher.add(rid, tokens_of[rid], now, urgent=rid in realtime)
            elif isinstance(d, Finished) and d.req.id in arrived:
                arrived.pop(d.req.id, None)  # refused / timed out: not completed
        release(now)

    def release(now: float) -> None:
        nonlocal timer_at
        rep = sched.replicas[REPLICA]
        for batch in batcher.release(now, rep.free > 0):
            run(batch, now)
        d = batcher.deadline()
        if d is not None and d != timer_at:
            timer_at = d
            heapq.heappush(events, (d, next(seq), "timer", None))

    def run(batch: Batch, now: float) -> None:
        res.batches += 1
        res.batched += len(batch.rids)
        cost = wl.overhead_s + wl.token_s * batch.tokens
        i = min(range(len(busy_until)), key=busy_until.__getitem__)
        start = max(now, busy_until[i])
        busy_until[i] = start + cost
        heapq.heappush(events, (start + cost, next(seq), "done", batch))

    now = 0.0
    last = 0.0
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            assert isinstance(payload, tuple)
            rt = bool(payload[0])
            ntok = int(payload[1])
            rid = f"e{next(ids)}"
            res.sent += 1
            req = sched.make_request(
                rid, QosInputs(qos_class="realtime" if rt else "batch"), now, ntok, 1, "")
            arrived[rid] = now
            tokens_of[rid] = ntok
            if rt:
                realtime.add(rid)
            apply(list(sched.submit(req, now)), now)
        elif kind == "timer":
            if timer_at == now:
                timer_at = None
            release(now)
        elif kind == "done":
            batch = payload
            assert isinstance(batch, Batch)
            for rid in batch.rids:
                start = arrived.pop(rid, None)
                if start is None:
                    continue
                res.completed += 1
                (res.rt_latencies if rid in realtime else res.latencies).append(now - start)
                last = now
                apply(list(sched.complete(rid, now, 0, tokens_of[rid])), now)
            dec = batcher.finished(now, batch)
            if dec is not None:
                res.decisions[dec.decision] = res.decisions.get(dec.decision, 0) + 1
            release(now)
        nt = sched.next_timer()
        if nt is not None and nt <= now:
            apply(list(sched.tick(now)), now)
    res.span_s = last
    res.linger_s = batcher.linger_s
    return res


SETTINGS: list[tuple[str, str, float]] = [
    ("off", "off", 0.0),
    ("fixed 10 ms", "fixed", 0.010),
    ("fixed 50 ms", "fixed", 0.050),
    ("fixed 100 ms", "fixed", 0.100),
    ("adaptive", "adaptive", 0.0),
]


def compare(rates: list[float], *, seconds: float = 30.0, seed: int = 1,
            max_inflight: int = 0, parallel: int = 1, realtime_share: float = 0.0,
            target_s: float = 0.150) -> list[EmbedResult]:
    out: list[EmbedResult] = []
    for rate in rates:
        wl = EmbedWorkload(rate, seconds, seed, realtime_share, parallel=parallel)
        for name, mode, w in SETTINGS:
            ctl = make_controller(mode, linger_s=w, target_s=target_s)
            out.append(simulate_embeddings(wl, ctl, BatchLimits(max_inflight=max_inflight),
                                           name))
    return out


def table(results: list[EmbedResult]) -> str:
    lines = [
        f"| {'rate/s':>6} | {'window':<12} | {'req/s':>6} | {'p50 ms':>7} | {'p99 ms':>7} | "
        f"{'rt p99':>7} | {'batch':>5} | {'end window ms':>13} | {'decisions':<24} |",
        f"|{'-' * 8}|{'-' * 14}|{'-' * 8}|{'-' * 9}|{'-' * 9}|{'-' * 9}|{'-' * 7}|{'-' * 15}|"
        f"{'-' * 26}|",
    ]
    for r in results:
        dec = ", ".join(f"{k} {v}" for k, v in sorted(r.decisions.items())) or "-"
        lines.append(
            f"| {r.rate:>6g} | {r.name:<12} | {r.throughput:>6.1f} | {r.pct(0.5) * 1e3:>7.1f} | "
            f"{r.pct(0.99) * 1e3:>7.1f} | {r.pct(0.99, True) * 1e3:>7.1f} | "
            f"{r.mean_batch:>5.1f} | {r.linger_s * 1e3:>13.1f} | {dec:<24} |")
    return "\n".join(lines)
