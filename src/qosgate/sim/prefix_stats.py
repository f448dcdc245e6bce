"""What a run did with the engines' prefix caches, against what one perfect cache could do.

- Hit rate: the engines' ``prefix_cache_hits / prefix_cache_queries`` (tokens, first admissions,
  as vLLM counts them), over the fleet and per replica. With a host KV tier the hits loaded from
  it (``external_prefix_cache_hits``) count too, and ``host_share`` says which part of the hits
  they are.
- Ideal hit rate: one infinite cache in front of every request as offered (arrival order), with
  vLLM's rules: a request finds at most ``(prompt - 1) // block`` leading blocks (the last prompt
  token is always computed) and leaves its full prompt blocks cached. No router can beat it.
- Fleet-KV ideal: the same with one LRU cache as large as the whole fleet's KV, GPU and host
  tiers summed (and nothing held by running requests): what perfect routing could hope for if
  the replicas' caches were pooled. On a trace whose prompts come back minutes later it sits
  well below the infinite ideal.
- Prefill tokens computed (by the engines, recomputation after a KV eviction included) against
  offered (every request's prompt tokens): what the caches saved. Requests refused or timed out
  before their prefill are offered and never computed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from qosgate.models.prefix_cache import PrefixCache
from qosgate.sim.workload import Arrival


def ideal_hits(arrivals: Iterable[Arrival], cache_tokens: int | None = None) -> tuple[int, int]:
    """(hit tokens, queried tokens) of one cache over ``arrivals`` in order: unbounded, or an
    LRU of ``cache_tokens`` (the engine's own cache: the same lookup, pins and eviction)."""
    cache = PrefixCache()
    hits = queries = 0
    for a in arrivals:
        queries += a.prompt
        pf = a.prefix
        if pf is None or not pf.keys:
            continue
        block = pf.block_tokens
        full = pf.keys[: a.prompt // block]
        hits += cache.lookup(full, (a.prompt - 1) // block) * block
        cache.touch(full, block)
        if cache_tokens is not None:
            cache.trim(cache_tokens)
    return hits, queries


def workload_ideals(arrivals: Sequence[Arrival], fleet_kv_tokens: int) -> dict[str, Any]:
    """What a workload offers, whatever the router: its prompt tokens, and the two ideal hit
    rates (computed once per workload, shared by every run on it)."""
    ideal_h, ideal_q = ideal_hits(arrivals)
    pooled_h, _ = ideal_hits(arrivals, fleet_kv_tokens)
    return {
        "prefill_tokens_offered": sum(a.prompt for a in arrivals),
        "ideal_hit_rate": _rate(ideal_h, ideal_q),
        "ideal_fleet_kv_hit_rate": _rate(pooled_h, ideal_q),
        "fleet_kv_tokens": fleet_kv_tokens,
    }


def _rate(hits: int, queries: int) -> float | None:
    return hits / queries if queries else None


def prefix_metrics(
    per_replica: dict[str, dict[str, int]], ideals: dict[str, Any]
) -> dict[str, Any]:
    """The run's prefix-cache figures (``RunResult.prefix_cache`` per replica) beside its
    workload's ``workload_ideals``."""
    has_host = any("host_hits" in r for r in per_replica.values())
    host_hits = sum(r.get("host_hits", 0) for r in per_replica.values())
    hits = sum(r["hits"] for r in per_replica.values()) + host_hits
    queries = sum(r["queries"] for r in per_replica.values())
    computed = sum(r["prefill_tokens"] for r in per_replica.values())
    offered = ideals["prefill_tokens_offered"]
    rate = _rate(hits, queries)
    ideal = ideals["ideal_hit_rate"]
    return {
        "hit_rate": rate,
        **{k: v for k, v in ideals.items() if k != "prefill_tokens_offered"},
        "of_ideal": rate / ideal if rate is not None and ideal else None,
        "hits_tokens": hits,
        **({"host_hits_tokens": host_hits, "host_share": _rate(host_hits, hits)} if has_host
           else {}),
        "queries_tokens": queries,
        "prefill_tokens_computed": computed,
        "prefill_tokens_offered": offered,
        "computed_of_offered": computed / offered if offered else None,
        "replicas": {
            name: {**r, "hit_rate": _rate(r["hits"] + r.get("host_hits", 0), r["queries"])}
            for name, r in per_replica.items()
        },
    }
