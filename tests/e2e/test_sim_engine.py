"""``qosgate serve`` with no configuration: open mode, the built-in simulated engine, as a process
(its banner says so). Its routes and a cancelled stream, in this process:
``tests/server/test_open_mode.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.support.processes import Server, start_gateway

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def gateway(tmp_session: Path) -> Iterator[Server]:
    # the simulated engine by flag (llama.cpp is the default: tests/e2e/llama covers it); the rest
    # is the zero-config default
    gw = start_gateway(tmp_session, "--engine", "sim")
    yield gw
    gw.stop()


def test_works_at_once_in_open_mode(gateway: Server) -> None:
    log = gateway.log.read_text()
    assert "running OPEN" in log
    c = OpenAI(base_url=gateway.url + "/v1", api_key="anything", max_retries=0)
    assert [m.id for m in c.models.list().data] == ["qosgate-sim"]
    r = c.chat.completions.create(
        model="qosgate-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert r.choices[0].finish_reason == "length" and r.usage and r.usage.completion_tokens == 4
    chunks = list(c.chat.completions.create(
        model="qosgate-sim", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        stream=True, stream_options={"include_usage": True},
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert len(text.split()) == 5
    t = c.completions.create(model="qosgate-sim", prompt="abc", max_tokens=3)
    assert len(t.choices[0].text.split()) == 3
    parts = list(c.completions.create(model="qosgate-sim", prompt="abc", max_tokens=3,
                                      stream=True))
    assert len("".join(p.choices[0].text for p in parts).split()) == 3
