"""``POST /v1/embeddings`` end to end through the official ``openai`` client: gateways in front
of the vLLM stand-in (its ``/v1/embeddings`` gives deterministic vectors from the text and costs
a fixed overhead plus a per-token time per call).

- single and list inputs, float and base64, token arrays;
- a merged upstream call split back: each client its own vectors, in order, its own usage;
- realtime never waits for a linger;
- the adaptive linger grows under a steady stream and shrinks when batches miss the target;
- bad input is a 400 naming the field.
"""

from __future__ import annotations

import base64
import json
import struct
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from qosgate.wire.embeddings import text_vector
from tests.support.fleet import classes
from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import MODEL, Server, start_gateway, start_standin

pytestmark = pytest.mark.e2e

FIXED = """
upstreams:
  - {url: URL, name: standin, max_window: 64}
embeddings: {linger: fixed, linger_ms: WINDOW, max_batch: 4, max_input_tokens: 100}
"""

# (no slot kept for realtime: the eight clients below fill the window's first eight slots)
ADAPTIVE = """
upstreams:
  - {url: URL, name: standin, max_window: 64}
embeddings: {linger: adaptive, floor_ms: 10, ceiling_ms: 100, target_ms: 100, every: 3,
             alpha: 0.5, max_batch: 32}
classes: """ + json.dumps(classes()) + "\n"


@pytest.fixture(scope="module")
def stand(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_standin(tmp_path_factory.mktemp("emb"))
    yield s
    s.stop()


def gateway(tmp: Path, stand: Server, text: str, name: str, **kw: str) -> Server:
    cfg = tmp / f"{name}.yaml"
    body = text.replace("URL", stand.url)
    for k, v in kw.items():
        body = body.replace(k, v)
    cfg.write_text(body)
    return start_gateway(tmp, "--config", str(cfg))


@pytest.fixture(scope="module")
def gw(stand: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A 1-second fixed linger, at most 4 requests a batch."""
    g = gateway(tmp_path_factory.mktemp("gw"), stand, FIXED, "fixed", WINDOW="1000")
    yield g
    g.stop()


def client(g: Server) -> OpenAI:
    return OpenAI(base_url=g.url + "/v1", api_key="none", max_retries=0, timeout=30)


def upstream_batches(stand: Server) -> list[int]:
    _, _, body = http("GET", stand.url + "/debug/requests")
    return list(json.loads(body)["embed_batches"])


def reset(stand: Server) -> None:
    http("DELETE", stand.url + "/debug/requests")


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) < 1e-5 for x, y in zip(a, b, strict=True))


def test_single_and_list_float_and_base64(gw: Server) -> None:
    c = client(gw)
    with ThreadPoolExecutor(4) as ex:  # four at once: one batch, released on its size
        one = ex.submit(c.embeddings.create, input="hello world", model=MODEL,
                        encoding_format="float")
        many = ex.submit(c.embeddings.create, input=["alpha", "beta gamma", "delta"],
                         model=MODEL, encoding_format="float")
        b64 = ex.submit(c.embeddings.create, input=["alpha", "omega"], model=MODEL,
                        encoding_format="base64")
        toks = ex.submit(c.embeddings.create, input=[[1, 2, 3], [4, 5]], model=MODEL)
    r = one.result()
    assert r.object == "list" and r.model == MODEL
    assert len(r.data) == 1 and r.data[0].index == 0
    assert close(r.data[0].embedding, text_vector("hello world", 384))
    assert r.usage.prompt_tokens == 3 and r.usage.total_tokens == 3  # 11 chars / 4
    r = many.result()
    assert [d.index for d in r.data] == [0, 1, 2]
    for d, text in zip(r.data, ["alpha", "beta gamma", "delta"], strict=True):
        assert close(d.embedding, text_vector(text, 384))
    assert r.usage.prompt_tokens == 2 + 3 + 2
    r = b64.result()
    raw = r.data[1].embedding
    assert isinstance(raw, str)  # the client leaves base64 as it came when asked for it
    vec = list(struct.unpack("<384f", base64.b64decode(raw)))
    assert close(vec, text_vector("omega", 384))
    r = toks.result()  # the client's default: base64 on the wire, decoded by the client
    assert close(list(r.data[1].embedding), text_vector([4, 5], 384))
    assert r.usage.prompt_tokens == 5


def test_merged_upstream_call_is_split_back(gw: Server, stand: Server) -> None:
    reset(stand)
    c = client(gw)
    texts = ["a" * 40, "the quick brown fox", "z" * 80, "w"]
    barrier = threading.Barrier(len(texts))

    def one(text: str) -> Any:
        barrier.wait()
        return c.embeddings.create(input=text, model=MODEL, encoding_format="float")

    with ThreadPoolExecutor(len(texts)) as ex:
        answers = list(ex.map(one, texts))
    assert upstream_batches(stand) == [4]  # one upstream call for the four clients
    for r, text in zip(answers, texts, strict=True):
        assert len(r.data) == 1
        assert close(r.data[0].embedding, text_vector(text, 384))  # its own vector
        assert r.usage.prompt_tokens == (len(text) + 3) // 4  # its own usage
    _, _, m = http("GET", gw.url + "/metrics")
    released = metric_values(m.decode(), "qosgate_embeddings_batches_total")
    assert released[(("reason", "size"), ("replica", "standin"))] >= 1


def test_realtime_never_waits_for_the_linger(gw: Server) -> None:
    c = client(gw)
    t0 = time.monotonic()
    r = c.embeddings.create(input="now please", model=MODEL,
                            extra_headers={"x-qos-class": "realtime"})
    rt = time.monotonic() - t0
    assert close(r.data[0].embedding, text_vector("now please", 384))
    t0 = time.monotonic()
    c.embeddings.create(input="whenever", model=MODEL)
    other = time.monotonic() - t0
    assert other >= 1.0  # alone, a batch-class request waits its whole linger ...
    assert rt < 0.5  # ... realtime does not wait for it at all (the upstream call is 20 ms)
    _, _, m = http("GET", gw.url + "/metrics")
    released = metric_values(m.decode(), "qosgate_embeddings_batches_total")
    assert released[(("reason", "urgent"), ("replica", "standin"))] >= 1
    assert released[(("reason", "window"), ("replica", "standin"))] >= 1


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": "x" * 1000}, "input"),  # over max_input_tokens (100)
        ({"input": 5}, "input"),
        ({"input": ["a", 1]}, "input"),
        ({"input": [[1, -2]]}, "input"),
        ({}, "input"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
        ({"input": "a", "dimensions": 0}, "dimensions"),
        ({"input": "a", "model": 7}, "model"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(gw: Server, body: dict[str, Any],
                                             param: str) -> None:
    body = {"model": MODEL, **body} if "model" not in body else body
    c = client(gw)
    with pytest.raises(openai.BadRequestError) as exc:
        c.post("/embeddings", body=body, cast_to=object)
    err = exc.value.body
    assert isinstance(err, dict)
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert err["message"]


def linger_s(g: Server) -> float:
    _, _, m = http("GET", g.url + "/metrics")
    v = metric_values(m.decode(), "qosgate_embeddings_batch_window_seconds")
    return v[(("replica", "standin"),)]


def decisions(g: Server) -> dict[str, float]:
    _, _, m = http("GET", g.url + "/metrics")
    v = metric_values(m.decode(), "qosgate_embeddings_window_decisions_total")
    return {dict(k)["decision"]: n for k, n in v.items()}


def stream(g: Server, seconds: float, clients: int = 8) -> None:
    c = client(g)
    end = time.monotonic() + seconds

    def loop(i: int) -> None:
        n = 0
        while time.monotonic() < end:
            c.embeddings.create(input=f"client {i} text {n}", model=MODEL)
            n += 1

    with ThreadPoolExecutor(clients) as ex:
        list(ex.map(loop, range(clients)))


def test_the_linger_adapts(stand: Server, tmp_path: Path) -> None:
    g = gateway(tmp_path, stand, ADAPTIVE, "adaptive")
    try:
        start = linger_s(g)
        assert start == pytest.approx(0.055)  # between the floor and the ceiling
        # a steady stream, 20 ms a batch upstream: batches meet the 100 ms target easily
        deadline = time.monotonic() + 20
        while decisions(g).get("grow", 0) < 1 and time.monotonic() < deadline:
            stream(g, 1.0)
        grown = linger_s(g)
        assert decisions(g).get("grow", 0) >= 1
        assert grown > start
        # the upstream slows down tenfold: batches miss the target, the linger closes down
        http("POST", stand.url + "/admin/fault",
             json.dumps({"fault": "slow", "factor": 10}).encode(),
             {"content-type": "application/json"})
        try:
            deadline = time.monotonic() + 30
            while decisions(g).get("shrink", 0) < 1 and time.monotonic() < deadline:
                stream(g, 1.0)
            assert decisions(g).get("shrink", 0) >= 1
            assert linger_s(g) < grown
        finally:
            http("DELETE", stand.url + "/admin/fault")
    finally:
        g.stop()
