"""The stand-in's prefix cache as vLLM 0.32 shows it: ``vllm:prefix_cache_queries_total`` /
``vllm:prefix_cache_hits_total`` against a hand-computed expectation, and
``usage.prompt_tokens_details`` only with ``--enable-prompt-tokens-details``, where vLLM puts
it; ``--no-enable-prefix-caching`` turns the cache off."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qosgate.models.simmodel import load_profile, with_host_tier
from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import MODEL, Server, start_standin

pytestmark = pytest.mark.e2e

FAST = ("--time-scale", "0.05")


@pytest.fixture(scope="module")
def detailed(tmp_session: Path) -> Iterator[Server]:
    s = start_standin(tmp_session, *FAST, "--enable-prompt-tokens-details")
    yield s
    s.stop()


def chat(s: Server, content: str, stream: bool = False) -> dict[str, Any]:
    """A compact chat body (its canonical form is its own bytes but the closing bracket); the
    usage of the answer."""
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 1,
                            "messages": [{"role": "user", "content": content}]}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    code, _, out = http("POST", s.url + "/v1/chat/completions",
                        json.dumps(body, separators=(",", ":")).encode())
    assert code == 200, out
    if not stream:
        return dict(json.loads(out)["usage"])
    events = [json.loads(line[6:]) for line in out.decode().splitlines()
              if line.startswith("data: {")]
    return dict(events[-1]["usage"])


def counts(s: Server) -> tuple[float, float]:
    text = http("GET", s.url + "/metrics")[2].decode()
    assert "# TYPE vllm:prefix_cache_queries counter" in text
    assert "# TYPE vllm:prefix_cache_hits counter" in text
    (q,) = metric_values(text, "vllm:prefix_cache_queries_total").items()
    (h,) = metric_values(text, "vllm:prefix_cache_hits_total").items()
    assert dict(q[0]) == {"engine": "0", "model_name": MODEL}
    return q[1], h[1]


def test_hits_and_queries_as_computed_by_hand(detailed: Server) -> None:
    # messages [{"role":"user","content":X}], X 1250 characters: the raw span is 30 + 1250
    # characters, 320 prompt tokens (characters / 4); its canonical form
    # [[{"role":"user"},"X"  -- 19 + 1250 + 1 characters -- is 19 full blocks of 16 tokens
    # (64 characters)
    x = "a" * 1250
    base = counts(detailed)
    a = chat(detailed, x)
    assert a["prompt_tokens"] == 320
    assert a["prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": None,
                                          "multimodal_tokens": None}
    # the same prompt again: all 19 blocks cached (vLLM computes the last token anyway, and
    # (320 - 1) // 16 = 19 blocks may be taken)
    b = chat(detailed, x, stream=True)
    assert b["prompt_tokens_details"]["cached_tokens"] == 19 * 16
    # sharing the first 600 characters: [[{"role":"user"},"  and 600 a's = 619 characters,
    # 9 full blocks
    c = chat(detailed, "a" * 600 + "b" * 650)
    assert c["prompt_tokens_details"]["cached_tokens"] == 9 * 16
    q, h = counts(detailed)
    assert (q - base[0], h - base[1]) == (3 * 320, 19 * 16 + 9 * 16)


def test_completions_stream_reports_cached_tokens_alone(detailed: Server) -> None:
    body = {"model": MODEL, "prompt": "p" * 2000, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}
    for _ in range(2):
        code, _, out = http("POST", detailed.url + "/v1/completions", json.dumps(body).encode())
        assert code == 200
    usage = [json.loads(line[6:]) for line in out.decode().splitlines()
             if line.startswith("data: {")][-1]["usage"]
    # 2000 characters: 31 full blocks of 64, every one cached the second time
    assert usage["prompt_tokens_details"] == {"cached_tokens": 31 * 16}


def test_details_only_with_the_flag_and_no_cache_when_off(tmp_path: Path) -> None:
    plain = start_standin(tmp_path, *FAST)
    off = start_standin(tmp_path, *FAST, "--no-enable-prefix-caching",
                        "--enable-prompt-tokens-details")
    try:
        for _ in range(2):
            u = chat(plain, "z" * 3000)
            assert "prompt_tokens_details" not in u
            assert "prompt_tokens_details" not in chat(plain, "z" * 3000, stream=True)
            assert chat(off, "z" * 3000)["prompt_tokens_details"]["cached_tokens"] == 0
        assert counts(plain)[1] > 0  # the cache works without the details
        assert counts(off) == (0, 0)  # vLLM counts no lookup with the cache off
    finally:
        plain.stop()
        off.stop()


def test_kv_offloading_size_gives_the_engine_a_host_tier_and_its_counters(
    tmp_path: Path,
) -> None:
    """``--kv-offloading-size GiB`` as vLLM sizes it (whole blocks of the GiB over the KV bytes
    of a block); ``/metrics`` then carries vLLM's external (connector) prefix-cache counters."""
    s = start_standin(tmp_path, *FAST, "--kv-offloading-size", "2")
    try:
        chat(s, "a" * 1250)
        text = http("GET", s.url + "/metrics")[2].decode()
    finally:
        s.stop()
    assert "# TYPE vllm:external_prefix_cache_queries counter" in text
    (q,) = metric_values(text, "vllm:external_prefix_cache_queries_total").values()
    (h,) = metric_values(text, "vllm:external_prefix_cache_hits_total").values()
    assert (q, h) == (320, 0)  # the GPU had nothing: the whole prompt asked of the host tier
    prof = with_host_tier(load_profile("default"), 2, 16)
    assert prof.host_kv_tokens == (2 << 30) // (57_344 * 16) * 16
    with pytest.raises(ValueError, match="> 0 GiB"):
        with_host_tier(prof, 0, 16)


def test_without_kv_offloading_no_external_counters(detailed: Server) -> None:
    assert "external_prefix_cache" not in http("GET", detailed.url + "/metrics")[2].decode()
