"""Cache-aware routing through real processes: 3 vLLM stand-ins with prefix caches behind the
gateway, one multi-turn chat workload (``bench/multiturn.py``), the same traffic under each
router in one run.

    .venv/bin/python bench/cache_routing.py [--routers least-load,cache-aware,session-affinity]
        [--sessions 24] [--turns 8] [--think-s 0.3] [--time-scale 6] [--seed 1]

The defaults load the fleet near what it sustains without a cache's help (``--time-scale 6``:
every engine step takes six times the profile's H100 time, so the fleet saturates at a rate a
2-core machine drives without the client becoming the bottleneck).

Per router, on fresh processes (every cache cold): 3 stand-ins (``--enable-prompt-tokens-details``,
prefix caching on, vLLM's 16-token blocks) and a gateway with ``fleet.router`` set to it (and
``fleet.cache.prefill_tokens_per_s`` to the stand-ins' prefill rate); the
workload's sessions share one system prompt, and each turn resends the conversation so far with
the streamed answer and a new user message appended (seeded: every router sees the same
sessions, user messages and think times). Printed per router:

- TTFT p50 / p99 of the turns (client side, to the first content chunk);
- hit rate: ``vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total`` summed over the
  stand-ins' ``/metrics`` (prompt tokens found cached / looked up), and each replica's; and
  the ideal (one infinite cache: every turn finds its session's previous prompt, a session's
  first turn the system prompt once any turn has run), from the turns' reported prompt tokens;
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

from bench.multiturn import (  # noqa: E402
    MultiTurn,
    Turn,
    prefix_cache_counts,
    run_sessions,
    summarize,
)
from qosgate import config as qconfig  # noqa: E402
from qosgate.models.simmodel import load_profile  # noqa: E402
from qosgate.wire.parse import CHARS_PER_TOKEN  # noqa: E402
from tests.support.metrics import metric_values  # noqa: E402
from tests.support.processes import Server, start_gateway, start_standin  # noqa: E402

ROUTERS = ("least-load", "cache-aware", "session-affinity")
REPLICAS = 3
CAPACITY = 32  # each upstream's window


def ideal_hit_rate(turns: list[Turn], system_tokens: int) -> float:
    """The hit rate of one infinite cache: a turn finds its session's previous prompt (a
    prefix of its own), a session's first turn the system prompt unless it is the very first
    turn of the run."""
    last: dict[int, int] = {}
    hits = total = 0
    for t in sorted(turns, key=lambda t: t.sent):
        if t.prompt_tokens is None:
            continue
        total += t.prompt_tokens
        if t.session in last:
            hits += last[t.session]
        elif total > t.prompt_tokens:
            hits += min(system_tokens, t.prompt_tokens)
        last[t.session] = t.prompt_tokens
    return hits / total if total else float("nan")


@dataclass
class Outcome:
    router: str
    summary: dict[str, float]
    ideal: float = float("nan")
    queries: list[float] = field(default_factory=list)
    hits: list[float] = field(default_factory=list)
    offered: dict[str, float] = field(default_factory=dict)
    split_sessions: int = 0
    seconds: float = 0.0


def gateway(tmp: Path, urls: list[str], router: str, time_scale: float) -> Server:
    """A gateway over ``urls`` with ``router``, told the stand-ins' prefill rate (the
    profile's at ``time_scale``), as an operator tells it their engines'."""
    rate = 1.0 / (load_profile("default").prefill_s_per_token * time_scale)
    cfg: dict[str, Any] = {
        "classes": [c.model_dump(exclude_none=True) for c in qconfig.default_config().classes],
        "upstreams": [{"url": u, "name": f"r{i}", "max_window": CAPACITY,
                       "priority_polarity": "vllm"} for i, u in enumerate(urls)],
        "fleet": {"router": router, "cache": {"prefill_tokens_per_s": round(rate)}},
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
    gw = gateway(tmp, urls, router, time_scale)
    try:
        t0 = time.monotonic()
        turns = await run_sessions(gw.url, w)
        out = Outcome(router, summarize(turns), seconds=time.monotonic() - t0,
                      ideal=ideal_hit_rate(turns, w.system_chars // CHARS_PER_TOKEN))
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
    head = (f"{'router':<18}{'TTFT p50':>10}{'TTFT p99':>10}{'hit rate':>10}{'ideal':>7}"
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
              f"{h / q if q else float('nan'):>10.3f}{o.ideal:>7.3f}{s['tokens_per_s']:>9.0f}"
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
    p.add_argument("--sessions", type=int, default=24)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--system-chars", type=int, default=4000)
    p.add_argument("--user-chars", type=int, default=1600, help="mean user message length")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--think-s", type=float, default=0.3)
    p.add_argument("--ramp-s", type=float, default=2.0)
    p.add_argument("--time-scale", type=float, default=6.0)
    p.add_argument("--seed", type=int, default=1)
    asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    main()
