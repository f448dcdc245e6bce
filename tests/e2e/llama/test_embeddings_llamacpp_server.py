"""A real upstream for ``/v1/embeddings``: llama-cpp-python's own OpenAI server
(``python -m llama_cpp.server --embedding true``) with the SmolLM2 GGUF. Three clients' single
inputs go to it as one merged call and come back split: each client gets what the server answered
for its own input at its place in the merged list, in order, with its share of the usage.

That server returns token-level vectors for a model without pooling (SmolLM2 declares none); the
gateway mean-pools them, so the first input's vector equals the in-process engine's. The others do
not: llama-cpp-python 0.3.36's ``Llama.embed`` steps through the token vectors of a multi-input
batch by tokens instead of floats (``pos += size``, not ``size * n_embd``), so with pooling none
every input after the first gets wrong vectors. That is the server's answer, passed on as is; the
test compares with the server's own answer to the same list."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp.server.app", reason="llama-cpp-python[server] is not installed")

from openai import OpenAI

from qosgate.models.llama_embed import LlamaEmbedder
from qosgate.wire.embeddings import pooled
from tests.support.httpclient import http
from tests.support.llama import MODEL_PATH
from tests.support.metrics import metric_values
from tests.support.ports import free_port
from tests.support.processes import Server, start_gateway
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

ALIAS = "smollm2-embed"


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("lcs")
    port = free_port()
    s = Server(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(MODEL_PATH),
         "--embedding", "true", "--model_alias", ALIAS, "--n_threads", "1",
         "--host", "127.0.0.1", "--port", str(port), "--verbose", "false"],
        port, "/v1/models", tmp / "llama-server.log", ready_timeout=60,
    )
    yield s
    s.stop()


def test_merged_call_to_llama_cpp_server_split_back(llama_server: Server, tmp_path: Path
                                                   ) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        f"upstreams:\n  - {{url: {llama_server.url}, name: lcs, max_window: 8,"
        " scrape_metrics: false}\n"
        "embeddings: {linger: fixed, linger_ms: 5000, max_batch: 3}\n"
    )
    gw = start_gateway(tmp_path, "--config", str(cfg))
    try:
        c = OpenAI(base_url=gw.url + "/v1", api_key="none", max_retries=0, timeout=120)
        texts = ["the cat sat on the mat", "quantum physics", "hello"]

        def pending() -> float:
            _, _, m = http("GET", gw.url + "/metrics")
            v = metric_values(m.decode(), "qosgate_embeddings_batch_pending")
            return v[(("replica", "lcs"),)]

        def one(text: str) -> Any:
            return c.embeddings.create(input=text, model=ALIAS, encoding_format="float")

        with ThreadPoolExecutor(len(texts)) as ex:  # one after the other: a known order
            futures = []
            for i, text in enumerate(texts):
                futures.append(ex.submit(one, text))
                if i < len(texts) - 1:
                    assert wait_until(lambda n=i + 1: pending() == n, 30)
            answers = [f.result() for f in futures]
        _, _, m = http("GET", gw.url + "/metrics")
        text = m.decode()
        released = metric_values(text, "qosgate_embeddings_batches_total")
        assert released == {(("reason", "size"), ("replica", "lcs")): 1.0}  # one upstream call
        local = LlamaEmbedder(MODEL_PATH, n_batch=256, max_seqs=4, n_threads=1)
        try:
            want, counts = local.embed(list(texts))
        finally:
            local.close()
        # the server's own answer to the same merged list, mean-pooled as the gateway does
        _, _, raw = http("POST", llama_server.url + "/v1/embeddings",
                         json.dumps({"model": ALIAS, "input": texts}).encode(),
                         {"content-type": "application/json"}, timeout=120)
        direct = [pooled(d["embedding"]) for d in json.loads(raw)["data"]]
        total = 0
        for r, w in zip(answers, direct, strict=True):
            (d,) = r.data
            assert d.index == 0
            got = d.embedding
            assert len(got) == len(w)
            assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(got, w, strict=True))
            total += r.usage.prompt_tokens
        first = answers[0].data[0].embedding  # pooled right: equal to the in-process engine's
        assert math.isclose(sum(x * y for x, y in zip(first, want[0], strict=True)), 1.0,
                            abs_tol=1e-3)
        assert total == sum(counts)  # the upstream's usage, shared out among the clients
        assert all(r.usage.prompt_tokens >= 1 for r in answers)
    finally:
        gw.stop()
