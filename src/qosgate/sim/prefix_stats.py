"""What a run did with the engines' prefix caches, against what one perfect cache could do.

- Hit rate: the engines' ``prefix_cache_hits / prefix_cache_queries`` (tokens, first admissions,
  as vLLM counts them), over the fleet and per replica.
- Ideal hit rate: one infinite cache in front of every request as offered (arrival order), with
  vLLM's rules: a request finds at most ``(prompt - 1) // block`` leading blocks (the last prompt
  token is always computed) and leaves its full prompt blocks cached. No router can beat it on
  this fleet, since each replica's cache only ever sees part of the requests, and no cache
  holds a block before the request that computes it.
- Prefill tokens computed (by the engines, recomputation after a KV eviction included) against
  offered (every request's prompt tokens): what the caches saved. Requests refused or timed out
  before their prefill are offered and never computed.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from qosgate.sim.workload import Arrival


def ideal_hits(arrivals: Iterable[Arrival]) -> tuple[int, int]:
    """(hit tokens, queried tokens) of one infinite cache over ``arrivals`` in order."""
    seen: set[int] = set()
    hits = queries = 0
    for a in arrivals:
        queries += a.prompt
        pf = a.prefix
        if pf is None or not pf.keys:
            continue
        block = pf.block_tokens
        full = min(len(pf.keys), a.prompt // block)
        most = min(full, (a.prompt - 1) // block)
        n = 0
        for key in pf.keys[:most]:
            if key not in seen:
                break
            n += 1
        hits += n * block
        seen.update(pf.keys[:full])
    return hits, queries


def _rate(hits: int, queries: int) -> float | None:
    return hits / queries if queries else None


def prefix_metrics(
    per_replica: dict[str, dict[str, int]], arrivals: Iterable[Arrival]
) -> dict[str, Any]:
    """The run's prefix-cache figures (``RunResult.prefix_cache`` per replica), with the
    workload's ideal."""
    arrivals = list(arrivals)
    ideal_h, ideal_q = ideal_hits(arrivals)
    hits = sum(r["hits"] for r in per_replica.values())
    queries = sum(r["queries"] for r in per_replica.values())
    computed = sum(r["prefill_tokens"] for r in per_replica.values())
    offered = sum(a.prompt for a in arrivals)
    rate = _rate(hits, queries)
    ideal = _rate(ideal_h, ideal_q)
    return {
        "hit_rate": rate,
        "ideal_hit_rate": ideal,
        "of_ideal": rate / ideal if rate is not None and ideal else None,
        "hits_tokens": hits,
        "queries_tokens": queries,
        "prefill_tokens_computed": computed,
        "prefill_tokens_offered": offered,
        "computed_of_offered": computed / offered if offered else None,
        "replicas": {
            name: {**r, "hit_rate": _rate(r["hits"], r["queries"])}
            for name, r in per_replica.items()
        },
    }
