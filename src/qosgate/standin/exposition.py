"""The stand-in's ``GET /metrics``: vLLM 0.32's metric names and labels (``engine``,
``model_name``), read by the gateway as it reads vLLM's."""

from __future__ import annotations

from qosgate.models.simmodel import EngineMetrics


def vllm_metrics_text(model: str, m: EngineMetrics, itl_wall_s: float,
                      success: dict[str, int], prefix_caching: bool = True,
                      kv_offloading: bool = False) -> str:
    """The exposition: the simulated engine's counts ``m``, the inter-token latency's sum in
    wall seconds, what the engine finished by ``finished_reason``, and the prefix cache's
    lookups in tokens (none counted with ``prefix_caching`` off, as vLLM's); with
    ``kv_offloading`` (a host KV tier) also the connector's lookups, as vLLM names them."""
    lbl = f'engine="0",model_name="{model}"'
    lines = [
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{lbl}}} {m.num_running}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{lbl}}} {m.num_waiting}",
        "# TYPE vllm:kv_cache_usage_perc gauge",
        f"vllm:kv_cache_usage_perc{{{lbl}}} {m.kv_usage}",
        "# TYPE vllm:prompt_tokens_total counter",
        f"vllm:prompt_tokens_total{{{lbl}}} {m.prompt_tokens_total}",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{lbl}}} {m.generation_tokens_total}",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{lbl}}} {m.preemptions_total}",
        # vLLM has buckets too; the gateway reads the sum and the count
        "# TYPE vllm:inter_token_latency_seconds histogram",
        f'vllm:inter_token_latency_seconds_bucket{{{lbl},le="+Inf"}} {m.itl_tokens_total}',
        f"vllm:inter_token_latency_seconds_sum{{{lbl}}} {itl_wall_s}",
        f"vllm:inter_token_latency_seconds_count{{{lbl}}} {m.itl_tokens_total}",
        "# TYPE vllm:request_success_total counter",
    ]
    for reason, n in success.items():
        lines.append(
            f'vllm:request_success_total{{{lbl},finished_reason="{reason}"}} {n}'
        )
    queries = m.prefix_cache_queries_total if prefix_caching else 0
    hits = m.prefix_cache_hits_total if prefix_caching else 0
    lines += [
        # vLLM's counters (prometheus_client): the TYPE line names the family without _total
        "# TYPE vllm:prefix_cache_queries counter",
        f"vllm:prefix_cache_queries_total{{{lbl}}} {queries}",
        "# TYPE vllm:prefix_cache_hits counter",
        f"vllm:prefix_cache_hits_total{{{lbl}}} {hits}",
    ]
    if kv_offloading:
        lines += [
            "# TYPE vllm:external_prefix_cache_queries counter",
            f"vllm:external_prefix_cache_queries_total{{{lbl}}} "
            f"{m.external_prefix_cache_queries_total}",
            "# TYPE vllm:external_prefix_cache_hits counter",
            f"vllm:external_prefix_cache_hits_total{{{lbl}}} {m.external_prefix_cache_hits_total}",
        ]
    return "\n".join(lines) + "\n"
