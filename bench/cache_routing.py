"""Cache-aware routing through real processes: 3 vLLM stand-ins with prefix caches behind the
gateway, one multi-turn chat workload (``bench/multiturn.py``), the same traffic under each
router in one run.

    .venv/bin/python bench/cache_routing.py [--routers least-load,cache-aware,session-affinity]
        [--sessions 16] [--turns 8] [--time-scale 1.0] [--seed 1]

Per router, on fresh processes (every cache cold): 3 stand-ins (``--enable-prompt-tokens-details``,
prefix caching on, vLLM's 16-token blocks) and a gateway with ``fleet.router`` set to it; the
workload's sessions share one system prompt, and each turn resends the conversation so far with
the streamed answer and a new user message appended (seeded: every router sees the same
sessions, user messages and think times). Printed per router:

- TTFT p50 / p99 of the turns (client side, to the first content chunk), and mean;
- hit rate: ``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` summed over the
  stand-ins' ``/metrics`` (prompt tokens found cached / looked up), and each replica's;
- output tokens/s over the run, turns completed, refused (HTTP 4xx/5xx) and failed;
- how the turns spread: per replica, the prompt tokens it was offered (the gateway's
  ``qosgate_replica_prompt_tokens_total{kind="offered"}``), and how many sessions had their
  turns on more than one replica (from the stand-ins' ``/debug/requests``).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the one server-process wrapper lives with the tests

from bench.multiturn import MultiTurn, prefix_cache_counts, run_sessions, summarize  # noqa: E402
from qosgate import config as qconfig  # noqa: E402
from tests.gateway.conftest import Server, metric_values, start_gateway, start_standin  # noqa: E402

ROUTERS = ("least-load", "cache-aware", "session-affinity")
REPLICAS = 3
CAPACITY = 32  # each upstream's window


@dataclass
class Outcome:
    router: str
    summary: dict[str, float]
    queries: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)
    offered: dict[str, float] = field(default_factory=dict)
    split_sessions: int = 0
    seconds: float = 0.0


def gateway(tmp: Path, urls: list[str], router: str) -> Server:
    cfg: dict[str, Any] = {
        "classes": [c.model_dump(exclude_none=True) for c in qconfig.default_config().classes],
        "upstreams": [{"url": u, "name": f"r{i}", "capacity": CAPACITY,
                       "priority_polarity": "vllm"} for i, u in enumerate(urls)],
        "fleet": {"router": router},
    }
    path = tmp / f"gateway-{router}.json"
    path.write_text(json.dumps(cfg, indent=1))
    return start_gateway(tmp, "--config", str(path))


def replicas_of_sessions(urls: list[str]) -> dict[str, set[int]]:
    """Which stand-ins each session's turns reached: a session is found by its first user
    message (its identity in the bodies the stand-ins recorded)."""
    out: dict[str, set[int]] = {}
    for k, u in enumerate(urls):
        with urllib.request.urlopen(u + "/debug/requests", timeout=10) as r:
            recorded = json.loads(r.read())["requests"]
        for rec in recorded:
            body = json.loads(base64.b64decode(rec["body"]))
            msgs = body.get("messages") or []
            if len(msgs) >= 2:
                out.setdefault(msgs[1]["content"][:64], set()).add(k)
    return out


async def one_router(router: str, tmp: Path, w: MultiTurn, time_scale: float) -> Outcome:
    sis = [start_standin(tmp, "--time-scale", str(time_scale), "--enable-prompt-tokens-details")
           for _ in range(REPLICAS)]
    urls = [s.url for s in sis]
    gw = gateway(tmp, urls, router)
    try:
        t0 = time.monotonic()
        turns = await run_sessions(gw.url, w)
        out = Outcome(router, summarize(turns), seconds=time.monotonic() - t0)
        for u in urls:
            q, h = prefix_cache_counts(u)
            out.queries.append(q)
            out.hits.append(h)
        with urllib.request.urlopen(gw.url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        for labels, v in metric_values(text, "qosgate_replica_prompt_tokens_total").items():
            lb = dict(labels)
            if lb.get("kind") == "offered":
                out.offered[lb["replica"]] = v
        out.split_sessions = sum(1 for ks in replicas_of_sessions(urls).values() if len(ks) > 1)
        return out
    finally:
        gw.stop_timeout = 3.0
        gw.stop()
        for s in sis:
            s.stop()


def report(results: list[Outcome], w: MultiTurn) -> None:
    print(f"\n{w.sessions} sessions x {w.turns} turns, system prompt {w.system_chars} chars, "
          f"user {w.user_chars[0]}-{w.user_chars[1]} chars, answers {w.max_tokens} tokens, "
          f"think {w.think_s} s, seed {w.seed}; {REPLICAS} stand-ins")
    head = (f"{'router':<18}{'TTFT p50':>10}{'TTFT p99':>10}{'hit rate':>10}"
            f"{'tok/s':>9}{'done':>6}{'refused':>8}{'failed':>7}{'split':>7}  per replica: hit "
            "rate / offered prompt tokens")
    print(head)
    for o in results:
        s = o.summary
        q, h = sum(o.queries), sum(o.hits)
        per = "  ".join(
            f"r{k} {hk / qk if qk else float('nan'):.2f}/{o.offered.get(f'r{k}', 0):.0f}"
            for k, (qk, hk) in enumerate(zip(o.queries, o.hits, strict=True)))
        print(f"{o.router:<18}{s['ttft_p50'] * 1000:>8.0f}ms{s['ttft_p99'] * 1000:>8.0f}ms"
              f"{h / q if q else float('nan'):>10.3f}{s['tokens_per_s']:>9.0f}"
              f"{s['completed']:>6.0f}{s['refused']:>8.0f}{s['failed']:>7.0f}"
              f"{o.split_sessions:>7}  {per}")
    base = next((o for o in results if o.router == "least-load"), None)
    if base is not None and base.summary["ttft_p50"] > 0:
        for o in results:
            if o is base:
                continue
            a, b = o.summary, base.summary
            print(f"{o.router} vs least-load: TTFT p50 x{a['ttft_p50'] / b['ttft_p50']:.2f}, "
                  f"p99 x{a['ttft_p99'] / b['ttft_p99']:.2f}, tokens/s "
                  f"x{a['tokens_per_s'] / b['tokens_per_s']:.2f}")
    print("split: sessions whose turns reached more than one replica")


async def main_async(args: argparse.Namespace) -> None:
    w = MultiTurn(sessions=args.sessions, turns=args.turns, system_chars=args.system_chars,
                  user_chars=(args.user_chars // 2, args.user_chars * 3 // 2),
                  max_tokens=args.max_tokens, think_s=args.think_s, ramp_s=args.ramp_s,
                  seed=args.seed)
    results = []
    with tempfile.TemporaryDirectory(prefix="cache-routing-") as d:
        for router in args.routers.split(","):
            res = await one_router(router, Path(d), w, args.time_scale)
            print(f"{router}: {res.seconds:.1f} s", flush=True)
            results.append(res)
    report(results, w)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--routers", default=",".join(ROUTERS))
    p.add_argument("--sessions", type=int, default=16)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-chars", type=int, default=4000)
    p.add_argument("--user-chars", type=int, default=1600, help="mean user message length")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--think-s", type=float, default=0.5)
    p.add_argument("--ramp-s", type=float, default=2.0)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1)
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
