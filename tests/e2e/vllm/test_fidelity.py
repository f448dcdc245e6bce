"""Every row of ``tests/support/fidelity.py`` (the compatibility table of
``docs/reference/compatibility.md``) sent straight to a real vLLM 0.32 and through qosgate in
front of it, the two answers compared: identical (status, content type and body, the names and
times of the answer apart: ids, ``created``; log-probabilities to 1e-4), changed as the row
says, or refused as the row says.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.fidelity import ROWS, Row, anonymous
from tests.support.httpclient import http
from tests.support.json_match import same_json
from tests.support.processes import Server
from tests.support.vllm import MODEL

# the first test here may build the environment and start vLLM (minutes on a busy machine)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]


def call(server: Server, row: Row) -> tuple[int, str, Any]:
    """(status, content type, the answer: JSON, a stream's events as JSON, or the text)."""
    body = None if row.body is None else json.dumps(row.body).encode()
    headers = {"Content-Type": "application/json"} if body is not None else {}
    code, got_headers, data = http(row.method, server.url + row.path, body, headers, timeout=120)
    ctype = got_headers.get("content-type", "").split(";")[0]
    if ctype == "text/event-stream":
        events = [line[len(b"data: "):] for line in data.split(b"\n")
                  if line.startswith(b"data: ")]
        return code, ctype, [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]
    if ctype == "application/json" and data:
        return code, ctype, json.loads(data)
    return code, ctype, data.decode()


@pytest.mark.parametrize("row", ROWS, ids=[r.what for r in ROWS])
def test_through_qosgate_as_straight_to_vllm(gw_fcfs: Server, vllm_fcfs: Server,
                                             row: Row) -> None:
    direct = call(vllm_fcfs, row)
    via = call(gw_fcfs, row)
    if row.verdict == "identical":
        assert via[:2] == direct[:2], (via, direct)
        same_json(anonymous(via[2]), anonymous(direct[2]))
        if row.path.startswith("/v1/") and direct[0] == 200:
            assert direct[2]  # an answer, not an empty one
    elif row.path == "/v1/models":
        assert via[0] == direct[0] == 200
        theirs = {m["id"]: m for m in direct[2]["data"]}
        ours = {m["id"]: m for m in via[2]["data"]}
        same_json(anonymous(ours[MODEL]), anonymous(theirs[MODEL]))
    elif row.verdict == "changed":  # a body priority: the same answer, priority qosgate's
        assert via[0] == direct[0] == 200, (via, direct)
        same_json(anonymous(via[2]), anonymous(direct[2]))
    else:
        assert direct[0] == 404
        err = via[2]["error"]
        assert via[0] == 404 and err["code"] == "not_found", via
        assert "POST /v1/chat/completions" in err["message"]
