"""An image through the gateway, end to end: the official ``openai`` client, a gateway in front of
the vLLM stand-in. A 600 KB PNG is a few hundred tokens to a vision model, not its base64 length
/ 4: it must be admitted under a prompt limit far below that length, reach the engine byte for
byte, and be charged to its tenant what the image rule says.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.support.httpclient import http
from tests.support.media_files import png
from tests.support.metrics import metric_values
from tests.support.processes import MODEL, Server, gateway_from
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

CONFIG = """
tenants:
  - name: pix
    api_keys: [sk-pix]
admission: {max_prompt_tokens: 4000}
upstreams:
  - url: {URL}
    name: standin
"""


@pytest.fixture(scope="module")
def gateway(standin: Server, tmp_session: Path) -> Iterator[Server]:
    yield from gateway_from(tmp_session, "media.yaml", CONFIG.replace("{URL}", standin.url))


def prompt_tokens_charged(gw: Server) -> float:
    _, _, text = http("GET", gw.url + "/metrics")
    values = metric_values(text.decode(), "qosgate_tenant_tokens_total")
    return values.get((("kind", "prompt"), ("tenant", "pix")), 0.0)


def test_a_600_kb_image_is_admitted_forwarded_and_charged_by_its_size(
    gateway: Server, standin: Server
) -> None:
    image = png(512, 400, noise=True)  # incompressible: the file is about its raw size
    assert len(image) > 600_000
    url = "data:image/png;base64," + base64.b64encode(image).decode()
    text = "Describe this picture."
    sent: list[bytes] = []

    def keep(request: httpx.Request) -> None:
        sent.append(request.read())

    client = OpenAI(base_url=gateway.url + "/v1", api_key="sk-pix", max_retries=0,
                    http_client=httpx.Client(event_hooks={"request": [keep]}))
    before = prompt_tokens_charged(gateway)
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=2, stream=True,
        messages=[{"role": "user", "content": [
            {"type": "text", "text": text},
            {"type": "image_url", "image_url": {"url": url}},
        ]}],
    )
    chunks = list(stream)  # admitted (the old estimate, ~205k tokens, was a 413)
    assert chunks

    # the engine got the client's bytes (no priority polarity configured: no priority
    # spliced), asked for its token ids (a stream that could continue elsewhere)
    _, _, body = http("GET", standin.url + "/debug/requests")
    forwarded = base64.b64decode(json.loads(body)["requests"][-1]["body"])
    assert len(sent) == 1 and forwarded == b'{"return_token_ids":true,' + sent[0][1:]

    # charged: the text as characters / 4 plus 252 image tokens (504 x 392 px after the
    # Qwen2-VL resize, 28 px a token); the stream asked no usage, so the charge stays the
    # gateway's estimate
    msgs = json.dumps(json.loads(sent[0])["messages"], separators=(",", ":"))
    text_tokens = (len(msgs) - len(url)) // 4
    assert text_tokens < 40
    assert wait_until(lambda: prompt_tokens_charged(gateway) > before)
    charged = prompt_tokens_charged(gateway) - before
    assert abs(charged - (252 + text_tokens)) <= 15, charged


def test_a_prompt_too_long_with_an_image_says_how_it_was_counted(gateway: Server) -> None:
    url = "data:image/png;base64," + base64.b64encode(png(64, 64)).decode()
    body = json.dumps({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "x" * 20_000},
        {"type": "image_url", "image_url": {"url": url}},
    ]}]}).encode()
    code, _, out = http("POST", gateway.url + "/v1/chat/completions", body,
                        {"Authorization": "Bearer sk-pix"})
    assert code == 400, out
    err = json.loads(out)["error"]
    assert err["code"] == "prompt_too_long" and err["param"] == "messages"
    assert "1 image counted from its size by the patches rule" in err["message"], err
