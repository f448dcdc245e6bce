"""Honest answers about upstreams, end to end through the ``openai``
client: an engine still loading is a 503 with Retry-After, not a permanent 404; an engine's
429/503 keeps its Retry-After; an engine's 4xx reaches the client in OpenAI's format and counts
as ``rejected``, not ``failed``. (A 5xx the retries cannot get past is a 502 in OpenAI's format:
``tests/runtime/upstream/test_errors.py``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from tests.support.fleet import (
    ask,
    client,
    outcomes,
    running,
    scrape,
    switch,
    upstream,
    write_config,
)
from tests.support.httpclient import http
from tests.support.ports import free_port
from tests.support.processes import MODEL, Server, gateway_args, start_standin


def _gateway(tmp: Path, cfg: Path) -> Server:
    port = free_port()  # ready once it serves at all: /readyz is 503 while no engine is up
    return Server(gateway_args(port, "--config", str(cfg)), port,
                  "/healthz", tmp / f"gateway-{port}.log")


@pytest.mark.e2e
def test_an_engine_not_up_yet_is_a_503_with_retry_after_not_a_404(tmp_path: Path) -> None:
    dead = free_port()  # nothing listens here: a vLLM still loading its model
    cfg = write_config(tmp_path / "c.yaml", [{"url": f"http://127.0.0.1:{dead}", "name": "r0"}])
    gw = _gateway(tmp_path, cfg)
    with running(gw):
        code, headers, body = http(
            "POST", gw.url + "/v1/chat/completions",
            json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode(),
            {"Authorization": "Bearer sk-admin", "Content-Type": "application/json"},
        )
        assert code == 503, body
        assert int(headers["retry-after"]) >= 1
        err = json.loads(body)["error"]
        assert err["code"] == "model_unavailable" and err["type"] == "overloaded_error"
        assert http("GET", gw.url + "/readyz")[0] == 503
    log = gw.log.read_text()
    assert "is not ready at start-up" in log  # said once, at start-up


@pytest.mark.e2e
def test_an_engine_4xx_reaches_the_client_as_is_and_counts_as_rejected(tmp_path: Path) -> None:
    s = start_standin(tmp_path, "--max-model-len", "64")
    with running(s):  # stopped even if the gateway does not start
        cfg = write_config(tmp_path / "c.yaml", [upstream(s, "r0")])
        gw = _gateway(tmp_path, cfg)
        with running(gw):
            c = client(gw)
            with pytest.raises(openai.BadRequestError) as exc:
                ask(c, max_tokens=1000)  # over the engine's context: its own 400
            assert exc.value.status_code == 400
            body = exc.value.body
            assert isinstance(body, dict) and "max_model_len" in str(body.get("message"))
            counted = outcomes(scrape(gw))
            assert counted[("rejected", "upstream_400")] == 1
            assert not any(o == "failed" for o, _ in counted)


@pytest.mark.e2e
def test_an_engine_429_keeps_its_retry_after_when_no_retry_gets_past(tmp_path: Path) -> None:
    s = start_standin(tmp_path)
    with running(s):  # stopped even if the gateway does not start
        cfg = write_config(tmp_path / "c.yaml", [upstream(s, "r0")])
        gw = _gateway(tmp_path, cfg)
        with running(gw):
            switch(s, {"fault": "429", "retry_after": 7, "for": 120})
            code, headers, body = http(
                "POST", gw.url + "/v1/chat/completions",
                json.dumps({"model": MODEL, "max_tokens": 3, "messages": [
                    {"role": "user", "content": "hi"}]}).encode(),
                {"Authorization": "Bearer sk-admin", "Content-Type": "application/json"},
                timeout=30,
            )
            # the only replica cools for 7 s; the request waits for it, then is answered 429 again
            # after its attempts: the client hears the engine's own Retry-After
            assert code == 503, body
            assert int(headers["retry-after"]) == 7
            assert json.loads(body)["error"]["code"] == "upstream_429"
