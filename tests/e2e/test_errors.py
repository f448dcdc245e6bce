"""An unknown class or task type is a 400 naming the member or the header it came in, end to end
through a gateway in front of the vLLM stand-in, on the chat route and on the embeddings route
(which the simulated engine does not serve). The gateway's other errors, in this process:
``tests/server/test_errors.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

from tests.support.processes import MODEL, Server, gateway_from

CONFIG = """
tenants:
  - name: acme
    api_keys: [sk-acme]
upstreams:
  - url: {URL}
    name: standin
"""


@pytest.fixture(scope="module")
def gateway(standin: Server, tmp_session: Path) -> Iterator[Server]:
    yield from gateway_from(tmp_session, "errors.yaml", CONFIG.replace("{URL}", standin.url))


def client(gw: Server, key: str = "sk-acme") -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def test_unknown_class_names_the_member_or_the_header(gateway: Server) -> None:
    c = client(gateway)
    msgs: Any = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                  extra_body={"qos_class": "gold"})
    assert exc.value.code == "unknown_class" and exc.value.param == "qos_class"
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                  extra_headers={"x-qos-class": "gold"})
    assert exc.value.code == "unknown_class" and exc.value.param == "x-qos-class"
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=1,
                                  extra_body={"task_type": "poetry"})
    assert exc.value.code == "unknown_task_type" and exc.value.param == "task_type"
    with pytest.raises(openai.BadRequestError) as exc:
        c.embeddings.create(model=MODEL, input="hi", extra_headers={"x-qos-class": "gold"})
    assert exc.value.code == "unknown_class" and exc.value.param == "x-qos-class"
