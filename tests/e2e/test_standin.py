"""The vLLM stand-in on its own: vLLM 0.32's priority rule under fcfs, its metric names.

(``tests/e2e/vllm/test_contract.py`` checks the same answers against the real vLLM 0.32.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.httpclient import http
from tests.support.processes import MODEL, Server, start_standin

pytestmark = pytest.mark.e2e


def test_fcfs_accepts_and_ignores_nonzero_priority_like_vllm(tmp_session: Path) -> None:
    s = start_standin(tmp_session, "--time-scale", "0.1", "--record",
                      str(tmp_session / "bodies.jsonl"))
    try:
        ok = b'{"prompt":"x","max_tokens":2,"priority":0}'
        assert http("POST", s.url + "/v1/completions", ok)[0] == 200
        code, _, body = http("POST", s.url + "/v1/completions",
                             b'{"prompt":"x","max_tokens":2,"priority":1}')
        assert code == 200, body  # vLLM 0.32: accepted and ignored (older vLLM: 400)
        code, _, body = http("POST", s.url + "/v1/completions",
                             b'{"model":"other","prompt":"x"}')
        assert code == 404
        lines = (tmp_session / "bodies.jsonl").read_text().splitlines()
        assert len(lines) == 3 and json.loads(lines[0])["path"] == "/v1/completions"
    finally:
        s.stop()


def test_metrics_use_vllm_names(standin: Server) -> None:
    http("POST", standin.url + "/v1/chat/completions",
         json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                     "max_tokens": 2}).encode())
    _, _, text = http("GET", standin.url + "/metrics")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
                 "vllm:generation_tokens_total", "vllm:num_preemptions_total",
                 "vllm:inter_token_latency_seconds_sum",
                 "vllm:inter_token_latency_seconds_count", "vllm:request_success_total"):
        assert name.encode() in text, name
