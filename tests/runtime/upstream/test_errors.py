"""An upstream's failure in OpenAI's format: a 5xx the retries cannot get past is a 502, an
engine's HTML error page is wrapped, an engine's own OpenAI error passes as it is. (The same
through real processes: ``tests/e2e/test_upstream_errors.py``.)"""

from __future__ import annotations

import json

from qosgate.core import Request, State
from qosgate.runtime.upstream.errors import error_body
from qosgate.server.errors import outcome_error


def test_a_5xx_no_retry_got_past_is_a_502_in_openai_format_even_from_html() -> None:
    req = Request("r", "t", "api", 1, 0.0, 5.0, 10, 10)
    req.move(State.QUEUED)
    req.move(State.DISPATCHED)
    req.move(State.FAILED, "upstream_500")
    status, body, headers = outcome_error(req)
    err = json.loads(body)["error"]
    assert status == 502 and err["code"] == "upstream_500" and headers == []
    # an engine's HTML error page, passed on to a client, is wrapped in OpenAI's format
    wrapped = json.loads(error_body(400, b"<html><h1>Bad</h1></html>", b"text/html"))
    assert wrapped["error"]["code"] == "upstream_400"
    assert "<h1>Bad</h1>" in wrapped["error"]["message"]
    # vLLM's own error, its numeric code included, passes byte for byte
    same = b'{"error":{"message":"m","type":"BadRequestError","param":null,"code":400}}'
    assert error_body(400, same, b"application/json") == same
