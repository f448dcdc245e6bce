"""Real vLLM in the loop: the model it serves, its limits, and reads of its engine state.

The vLLM servers themselves are session fixtures in ``tests/e2e/vllm/conftest.py``.
"""

from __future__ import annotations

import time
from typing import Any

from openai import OpenAI

from qosgate.core.signals import LoadSignals
from qosgate.wire.engine_metrics import parse_engine_metrics
from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import Server
from tests.support.waiting import wait_until

MODEL = "smollm2-135m-instruct"


MAX_MODEL_LEN = 2048


MAX_NUM_SEQS = 2


GHOST = "not-served-by-vllm"  # listed in the gateway's config, unknown to vLLM: vLLM's own 404


# each vLLM's KV-event endpoint (by its URL), for the tests of precise cache-aware routing
KV_EVENTS: dict[str, str] = {}


KV_TOPIC = "kv"


def client(server: Server, **kw: Any) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, **kw)


# ---------------------------------------------------------------------- engine state
def signals(engine: Server) -> LoadSignals:
    _, _, text = http("GET", engine.url + "/metrics")
    return parse_engine_metrics(text.decode(), time.monotonic(), engine="vllm")


def finished(engine: Server, reason: str) -> float:
    _, _, text = http("GET", engine.url + "/metrics")
    values = metric_values(text.decode(), "vllm:request_success_total")
    return sum(v for k, v in values.items() if ("finished_reason", reason) in k)


def wait_idle(engine: Server, timeout: float = 120.0) -> None:
    """Nothing running or waiting in the engine (the previous test's requests are gone)."""
    assert wait_until(
        lambda: (s := signals(engine)).running == 0 and s.waiting == 0, timeout, every=0.1
    ), f"engine still busy: {signals(engine)}"
