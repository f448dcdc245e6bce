"""The request log of ``qosgate serve --request-log FILE --request-log-sample 1`` in front of the
stand-in: one id from end to end -- the client's answer (``x-qosgate-request-id``), the engine's
request (``X-Request-Id``, on every attempt) and the log's one line -- for a served request and
for one the engine failed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.httpclient import http
from tests.support.processes import MODEL, Server, start_gateway, start_standin
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

CHAT = json.dumps({"model": MODEL, "max_tokens": 2,
                   "messages": [{"role": "user", "content": "hi"}]}).encode()


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_standin(tmp_path_factory.mktemp("standin"), "--time-scale", "0.05")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def logged(standin: Server, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Server, Path]]:
    tmp = tmp_path_factory.mktemp("gateway")
    log = tmp / "requests.jsonl"
    gw = start_gateway(tmp, "--upstream", standin.url, "--request-log", str(log),
                       "--request-log-sample", "1")
    yield gw, log
    gw.stop()


def lines_of(log: Path, rid: str) -> list[dict[str, Any]]:
    if not log.exists():
        return []
    return [row for row in map(json.loads, log.read_text().splitlines()) if row["id"] == rid]


def the_line_of(log: Path, rid: str) -> dict[str, Any]:
    assert wait_until(lambda: lines_of(log, rid), 10), f"no line for {rid}"
    got = lines_of(log, rid)
    assert len(got) == 1, got
    return got[0]


def engine_ids(standin: Server) -> list[str | None]:
    """The X-Request-Id of each request the stand-in received, in order."""
    _, _, body = http("GET", standin.url + "/debug/requests")
    return [r.get("request_id") for r in json.loads(body)["requests"]]


def post(gw: Server) -> tuple[int, str, bytes]:
    code, headers, body = http("POST", gw.url + "/v1/chat/completions", CHAT,
                               {"Content-Type": "application/json"})
    return code, headers["x-qosgate-request-id"], body


def test_a_served_request_has_one_id_in_its_answer_at_the_engine_and_in_the_log(
        standin: Server, logged: tuple[Server, Path]) -> None:
    gw, log = logged
    http("DELETE", standin.url + "/debug/requests")
    code, rid, body = post(gw)
    assert code == 200, body
    assert engine_ids(standin) == [rid]
    line = the_line_of(log, rid)
    assert (line["outcome"], line["status"], line["replica"]) == ("completed", 200, "upstream-0")
    assert line["completion_tokens"] == json.loads(body)["usage"]["completion_tokens"]


def test_a_request_the_engine_failed_is_logged_with_its_attempts(
        standin: Server, logged: tuple[Server, Path]) -> None:
    gw, log = logged
    http("DELETE", standin.url + "/debug/requests")
    code, _, out = http("POST", standin.url + "/admin/fault", b'{"fault": "500"}')
    assert code == 200, out
    try:
        code, rid, body = post(gw)
    finally:
        http("DELETE", standin.url + "/admin/fault")
    assert code >= 500, body
    line = the_line_of(log, rid)
    assert (line["outcome"], line["status"]) == ("failed", code)
    assert line["reason"] == json.loads(body)["error"]["code"]
    attempts = engine_ids(standin)
    assert line["failed_attempts"] == len(attempts) >= 1
    assert attempts == [rid] * len(attempts)  # every attempt names the same request
