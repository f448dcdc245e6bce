"""What the client asked for output length is what the engine gets; only a configured ceiling
adds a cap, and the response says so. ``/v1/models`` is the engines' own list.

Real processes: the vLLM stand-in (its ``--record`` keeps every body it received) and gateways,
spoken to with the official ``openai`` client.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.support.httpclient import http
from tests.support.processes import MODEL, Server, gateway_from, start_standin

pytestmark = pytest.mark.e2e

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def engine(tmp_session: Path) -> Iterator[tuple[Server, Path]]:
    rec = tmp_session / "output-cap-record.jsonl"
    s = start_standin(tmp_session, "--time-scale", "0.05", "--max-model-len", "4096",
                      "--eos-after", "12", "--record", str(rec))
    yield s, rec
    s.stop()


def sent_bodies(rec: Path) -> list[dict[str, Any]]:
    """Every body the engine received, as it received it."""
    return [json.loads(base64.b64decode(json.loads(line)["body"]))
            for line in rec.read_text().splitlines()]


@pytest.fixture(scope="module")
def gw(engine: tuple[Server, Path], tmp_session: Path) -> Iterator[Server]:
    """The default classes; batch has an output ceiling of 40, the tenant 'tight' one of 20."""
    yield from gateway_from(tmp_session, "output-cap.yaml", f"""
classes:
  - {{name: realtime, level: 0, strict: true, ttft_budget_ms: 500, queue_timeout_s: 5,
      max_queue: 100}}
  - {{name: api, level: 1, weight: 5, ttft_budget_ms: 2000, queue_timeout_s: 30, max_queue: 100}}
  - {{name: batch, level: 2, weight: 3, ttft_budget_ms: 60000, queue_timeout_s: 300,
      max_queue: 100, max_output_tokens: 40}}
  - {{name: offline, level: 3, weight: 2, ttft_budget_ms: 300000, queue_timeout_s: 600,
      max_queue: 100}}
tenants:
  - {{name: acme, api_keys: [sk-acme]}}
  - {{name: tight, api_keys: [sk-tight], limits: {{max_output_tokens: 20}}}}
upstreams: [{{url: {engine[0].url}, name: standin, max_window: 4}}]
""")


def client(gw: Server, key: str = "sk-acme", cls: str | None = None) -> openai.OpenAI:
    headers = {"x-qos-class": cls} if cls else None
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, default_headers=headers,
                         max_retries=0, timeout=30)


def test_no_cap_stays_no_cap(gw: Server, engine: tuple[Server, Path]) -> None:
    raw = client(gw).chat.completions.with_raw_response.create(model=MODEL, messages=HI)
    resp = raw.parse()
    sent = sent_bodies(engine[1])[-1]
    assert "max_tokens" not in sent and "max_completion_tokens" not in sent, sent
    # the engine's model ended the answer itself (12 tokens here), not a gateway cap
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and resp.usage.completion_tokens == 12
    assert raw.headers.get("x-qosgate-inserted-max-tokens") is None


def test_explicit_null_and_max_completion_tokens_go_as_sent(
    gw: Server, engine: tuple[Server, Path]
) -> None:
    c = client(gw)
    c.chat.completions.create(model=MODEL, messages=HI,  # type: ignore[call-overload]
                              extra_body={"max_tokens": None})
    sent = sent_bodies(engine[1])[-1]
    assert "max_tokens" in sent and sent["max_tokens"] is None
    c.chat.completions.create(model=MODEL, messages=HI,  # type: ignore[call-overload]
                              max_completion_tokens=5)
    sent = sent_bodies(engine[1])[-1]
    assert sent["max_completion_tokens"] == 5 and "max_tokens" not in sent


def test_a_configured_ceiling_is_inserted_and_said(
    gw: Server, engine: tuple[Server, Path]
) -> None:
    # batch's ceiling, for a request that asked for none: inserted, and the response says so
    raw = client(gw, cls="batch").completions.with_raw_response.create(
        model=MODEL, prompt="Hello")
    sent = sent_bodies(engine[1])[-1]
    assert sent["max_tokens"] == 40
    assert raw.headers["x-qosgate-inserted-max-tokens"] == "40"
    # the tenant's, smaller, wins; a client's max_completion_tokens: null is where it goes
    raw2 = client(gw, key="sk-tight").chat.completions.with_raw_response.create(
        model=MODEL, messages=HI, extra_body={"max_completion_tokens": None})
    sent = sent_bodies(engine[1])[-1]
    assert sent["max_completion_tokens"] == 20 and "max_tokens" not in sent
    assert raw2.headers["x-qosgate-inserted-max-tokens"] == "20"
    # within the ceiling: as asked, nothing said
    raw3 = client(gw, cls="batch").chat.completions.with_raw_response.create(
        model=MODEL, messages=HI, max_tokens=7)
    assert sent_bodies(engine[1])[-1]["max_tokens"] == 7
    assert raw3.headers.get("x-qosgate-inserted-max-tokens") is None


def test_asking_past_a_ceiling_is_a_400(gw: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(gw, cls="batch").chat.completions.create(model=MODEL, messages=HI, max_tokens=41)
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "max_tokens"
    assert "40" in err["message"] and "ceiling" in err["message"]


def test_models_are_the_engines_own(gw: Server, engine: tuple[Server, Path]) -> None:
    _, _, direct = http("GET", engine[0].url + "/v1/models")
    _, _, through = http("GET", gw.url + "/v1/models", headers={"Authorization": "Bearer sk-acme"})
    want, got = json.loads(direct), json.loads(through)
    for doc in (want, got):  # vLLM makes a new permission id for every answer
        for card in doc["data"]:
            for perm in card["permission"]:
                perm.pop("id")
    assert got == want, got
    card = got["data"][0]
    assert card["owned_by"] == "vllm" and card["max_model_len"] == 4096
    assert card["root"] == MODEL and card["parent"] is None
    listed = client(gw).models.list()
    assert [m.id for m in listed.data] == [MODEL]


def test_stream_options_without_a_stream_is_a_400(gw: Server) -> None:
    """The engine is always asked for a stream; stream_options without stream: true is still
    refused, as vLLM and OpenAI refuse it ({} asks for nothing and passes)."""
    with pytest.raises(openai.BadRequestError) as e:
        client(gw).chat.completions.create(  # type: ignore[call-overload]
            model=MODEL, messages=HI, max_tokens=2, stream_options={"include_usage": True})
    err = e.value.body
    assert isinstance(err, dict) and err["param"] == "stream_options"
    ok = client(gw).chat.completions.create(  # type: ignore[call-overload]
        model=MODEL, messages=HI, max_tokens=2, extra_body={"stream_options": {}})
    assert ok.choices[0].message.content
