"""The request log through the gateway in this process: a served request (sample 1), a refusal
before the scheduler (a bad key, an unknown model) and one by the scheduler (a tenant's rate
limit) each get exactly one line, and its id is the one the answer names (``x-qosgate-request-id``
and ``x-request-id``); with the defaults, refusals get a line and served requests none."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.inprocess import InProcessGateway
from tests.support.processes import MODEL
from tests.support.waiting import wait_until

CONFIG = """
tenants:
  - name: acme
    api_keys: [sk-acme]
  - name: limited
    api_keys: [sk-limited]
    limits: {requests_per_minute: 1}
engine: {served_model_name: MODEL}
request_log: LOG
"""


def chat(model: str = MODEL, max_tokens: int = 3) -> bytes:
    return json.dumps({"model": model, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hi"}]}).encode()


class Logged:
    """A gateway whose request log goes to a file, and the lines of that file by request id."""

    def __init__(self, tmp: Path, log: dict[str, Any]) -> None:
        self.path = tmp / "requests.jsonl"
        cfg = CONFIG.replace("MODEL", MODEL).replace(
            "LOG", json.dumps({**log, "path": str(self.path)}))
        self.gw = InProcessGateway(cfg)

    def post(self, body: bytes, key: str = "sk-acme", **headers: str
             ) -> tuple[int, dict[str, str], bytes]:
        return self.gw.http("POST", self.gw.url + "/v1/chat/completions", body,
                            {"Authorization": f"Bearer {key}", "Content-Type": "application/json",
                             **headers})

    def lines(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [json.loads(x) for x in self.path.read_text().splitlines()]

    def lines_of(self, rid: str) -> list[dict[str, Any]]:
        return [x for x in self.lines() if x["id"] == rid]

    def the_line_of(self, rid: str) -> dict[str, Any]:
        """The one line of ``rid`` (written once its answer is out: waited for)."""
        assert wait_until(lambda: self.lines_of(rid), 10), f"no line for {rid}: {self.lines()}"
        got = self.lines_of(rid)
        assert len(got) == 1, got
        return got[0]


@pytest.fixture(scope="module")
def every(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Logged]:
    logged = Logged(tmp_path_factory.mktemp("every"), {"sample": 1.0})
    with logged.gw:
        yield logged


@pytest.fixture(scope="module")
def defaults(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Logged]:
    logged = Logged(tmp_path_factory.mktemp("defaults"), {})
    with logged.gw:
        yield logged


def rid_of(headers: dict[str, str]) -> str:
    rid = headers["x-qosgate-request-id"]
    assert headers["x-request-id"] == rid  # OpenAI's header names the same id
    return rid


def test_a_served_request_s_line(every: Logged) -> None:
    code, headers, body = every.post(chat(), **{"X-Request-Id": "client-7"})
    assert code == 200, body
    rid = rid_of(headers)
    assert rid != "client-7"  # the client's id is repeated in the line, never taken as ours
    line = every.the_line_of(rid)
    usage = json.loads(body)["usage"]
    assert line["tenant"] == "acme" and line["class"] == headers["x-qosgate-class"]
    assert (line["model"], line["replica"], line["route"]) == (MODEL, "sim-0", "chat")
    assert (line["outcome"], line["reason"], line["status"]) == ("completed", "completed", 200)
    assert 0 <= line["queue_wait_s"] <= line["ttft_s"] <= line["duration_s"]
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    assert line["completion_tokens"] == usage["completion_tokens"]
    assert (line["failed_attempts"], line["preemptions"]) == (0, 0)
    assert line["client_request_id"] == "client-7"


def test_a_bad_key_s_refusal_names_its_id_and_gets_one_line(every: Logged) -> None:
    code, headers, body = every.post(chat(), key="sk-nobody")
    assert code == 401, body
    line = every.the_line_of(rid_of(headers))
    assert (line["tenant"], line["class"]) == ("unknown", "none")
    assert (line["outcome"], line["reason"], line["status"]) == (
        "rejected", json.loads(body)["error"]["code"], 401)
    assert line["replica"] is None and line["queue_wait_s"] is None


def test_an_unknown_model_s_refusal_gets_one_line(every: Logged) -> None:
    code, headers, body = every.post(chat(model="no-such-model"))
    assert code == 404, body
    line = every.the_line_of(rid_of(headers))
    assert line["tenant"] == "acme"
    assert (line["outcome"], line["reason"], line["status"]) == (
        "rejected", json.loads(body)["error"]["code"], 404)


def test_a_refusal_by_the_scheduler_gets_one_line(every: Logged) -> None:
    assert every.post(chat(), key="sk-limited")[0] == 200
    code, headers, body = every.post(chat(), key="sk-limited")
    assert code == 429, body
    line = every.the_line_of(rid_of(headers))
    assert (line["tenant"], line["outcome"], line["status"]) == ("limited", "rejected", 429)
    assert line["reason"] == json.loads(body)["error"]["code"] == "rate_limit_requests"


def test_by_default_refusals_get_a_line_and_served_requests_none(defaults: Logged) -> None:
    code, headers, _ = defaults.post(chat())
    assert code == 200
    served = rid_of(headers)
    code, headers, _ = defaults.post(chat(model="no-such-model"))
    assert code == 404
    refused = defaults.the_line_of(rid_of(headers))
    assert refused["outcome"] == "rejected"
    # the served request ended before the refusal arrived: its line would be there by now
    assert defaults.lines_of(served) == []
    assert [x["id"] for x in defaults.lines()] == [refused["id"]]


def test_a_bug_s_500_names_the_request_and_gets_one_line(
        every: Logged, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*args: object) -> None:
        raise RuntimeError("a bug in the flow")

    monkeypatch.setattr("qosgate.server.flow.prepare", broken)
    code, headers, body = every.post(chat())
    assert code == 500, body
    line = every.the_line_of(rid_of(headers))
    assert (line["outcome"], line["reason"], line["status"]) == (
        "rejected", "internal_error", 500)
