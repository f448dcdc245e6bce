"""A fuzz suite over the gateway's HTTP surface, against a real gateway process (the simulated
engine): bodies (valid, wrong types, malformed ``messages``, duplicated and escaped keys, cut
short, corrupted bytes, invalid UTF-8, deep nesting, large), headers (keys, classes in any case,
priorities, junk bytes), framing (Content-Length, chunked), both completion routes, streamed or
not.

For every request: no 5xx from the gateway; every error in OpenAI's format; a success well formed
(a whole JSON body with its Content-Length, or an SSE stream ending with ``[DONE]``); and the
request counted exactly once in /metrics (``qosgate_requests_total``, or, for bytes that are not
HTTP at all, ``qosgate_connections_refused_total``). Afterwards the gateway still serves.

Bounded and deterministic: hypothesis with ``derandomize=True`` (examples derived from the test
itself, no database), a few hundred examples.
"""

from __future__ import annotations

import json
import re
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import Server, start_gateway
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

CONFIG = """
tenants:
  - {name: acme, api_keys: [sk-acme], tier: pro}
  - {name: free, api_keys: [sk-free], tier: free, allowed_classes: [batch, offline]}
admission: {max_prompt_tokens: 20000, max_output_tokens: 64}
server:
  admin_keys: [sk-admin]
  header_timeout_s: 5
  body_timeout_s: 5
  max_header_bytes: 16384
  max_body_bytes: 1048576
engine: {kind: sim, time_scale: 0.01, eos_after: 4}
"""

ADMIN = {"Authorization": "Bearer sk-admin"}
ACTED = ["model", "stream", "max_tokens", "max_completion_tokens", "priority",
         "latency_budget_ms", "task_type", "qos_class", "stream_options", "messages", "prompt"]


@pytest.fixture(scope="module")
def gw(tmp_session: Path) -> Iterator[Server]:
    cfg = tmp_session / "fuzz.yaml"
    cfg.write_text(CONFIG)
    g = start_gateway(tmp_session, "--config", str(cfg))
    yield g
    g.stop()


def counts(gw: Server) -> tuple[float, float, float]:
    """(requests with an outcome, connections refused before a request existed, requests
    refused for a body over the limit)."""
    code, _, body = http("GET", gw.url + "/metrics", headers=ADMIN)
    assert code == 200
    text = body.decode()
    requests = metric_values(text, "qosgate_requests_total")
    return (sum(requests.values()),
            sum(metric_values(text, "qosgate_connections_refused_total").values()),
            sum(v for k, v in requests.items() if ("reason", "body_too_large") in k))


def counted(gw: Server) -> float:
    requests, refused, _ = counts(gw)
    return requests + refused


# ---------------------------------------------------------------------- strategies
scalars = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.integers(-3, 100)
           | st.floats(allow_nan=False) | st.text(max_size=20))
json_values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                                max_size=4),
    max_leaves=12,
)
content = st.one_of(st.text(max_size=60), st.just("x" * 50_000), json_values)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool"]),
                           "content": content}),
    json_values,
)
messages = st.one_of(st.lists(message, min_size=1, max_size=4), json_values)
member_values = {
    "model": st.one_of(st.just("qosgate-sim"), st.text(max_size=12), json_values),
    "stream": st.one_of(st.booleans(), json_values),
    "max_tokens": st.one_of(st.integers(-2, 80), json_values),
    "max_completion_tokens": st.one_of(st.integers(-2, 80), json_values),
    "priority": st.one_of(st.integers(-5, 6), json_values),
    "latency_budget_ms": st.one_of(st.floats(-10, 1e6, allow_nan=False), json_values),
    "task_type": st.one_of(st.sampled_from(["chat", "summarize", "analysis"]), st.text(max_size=8)),
    "qos_class": st.one_of(st.sampled_from(["realtime", "API", "Batch", "offline"]),
                           st.text(max_size=8)),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}),
                                json_values),
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(0, 9), max_size=3),
                        json_values),
    "tools": json_values,
    "n": st.integers(-1, 3),
}


# what a well-behaved client sends (so that requests also get through and are served)
valid_values = {
    "model": st.just("qosgate-sim"),
    "stream": st.booleans(),
    "max_tokens": st.integers(1, 64),
    "max_completion_tokens": st.integers(1, 64),
    "priority": st.integers(0, 3),
    "latency_budget_ms": st.floats(100, 1e6),
    "task_type": st.sampled_from(["chat", "summarize", "analysis"]),
    "qos_class": st.sampled_from(["realtime", "API", "Batch", "offline"]),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "prompt": st.one_of(st.text(min_size=1, max_size=30), st.lists(st.integers(0, 9), min_size=1,
                                                                    max_size=3)),
    "temperature": st.floats(0, 2),
}
valid_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                           "content": st.text(max_size=60)}),
    min_size=1, max_size=4,
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):  # a well-formed request, perhaps then damaged below
        obj: dict[str, Any] = {"messages": draw(valid_messages)}
        for key in draw(st.lists(st.sampled_from(sorted(valid_values)), max_size=5,
                                 unique=True)):
            obj[key] = draw(valid_values[key])
    else:
        obj = {"messages": draw(messages)}
        for key in draw(st.lists(st.sampled_from(sorted(member_values)), max_size=6,
                                 unique=True)):
            obj[key] = draw(member_values[key])
    obj.update(draw(st.dictionaries(st.text(max_size=6), json_values, max_size=2)))
    text = json.dumps(obj, ensure_ascii=draw(st.booleans()),
                      separators=draw(st.sampled_from([(",", ":"), (", ", ": ")])))
    body = text.encode("utf-8", "surrogatepass")
    how = draw(st.sampled_from(["as is", "as is", "duplicate", "escape", "truncate", "corrupt",
                                "invalid utf-8", "deep", "not an object", "huge"]))
    present = sorted(k for k in obj if k in ACTED)
    if how == "duplicate":
        key = draw(st.sampled_from(present))
        value = json.dumps(draw(valid_values.get(key, valid_messages))).encode()
        body = body[:-1] + b',"' + key.encode() + b'":' + value + b"}"
    elif how == "escape":
        key = draw(st.sampled_from(present))
        body = body.replace(b'"' + key.encode() + b'"',
                            b'"\\u00' + b"%x" % ord(key[0]) + key[1:].encode() + b'"', 1)
    elif how == "truncate":
        body = body[: draw(st.integers(0, max(0, len(body) - 1)))]
    elif how == "corrupt":
        i = draw(st.integers(0, max(0, len(body) - 1)))
        body = body[:i] + draw(st.binary(min_size=1, max_size=4)) + body[i + 1 :]
    elif how == "invalid utf-8":
        i = draw(st.integers(0, len(body)))
        body = body[:i] + draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80"])) \
            + body[i:]
    elif how == "deep":
        n = draw(st.integers(100, 3000))
        where = draw(st.sampled_from(["messages", "tools", "content"]))
        nest = b"[" * n + b"]" * n
        if where == "content":
            body = b'{"messages":[{"role":"user","content":' + nest + b"}]}"
        else:
            body = b'{"messages":[{"role":"user","content":"x"}],"' + where.encode() + b'":' \
                + nest + b"}"
    elif how == "huge":  # over server.max_body_bytes (1 MiB here)
        body = body[:-1] + b',"pad":"' + b"p" * (1 << 20) + b'"}'
    elif how == "not an object":
        body = draw(st.one_of(st.binary(max_size=64), st.sampled_from([b"[]", b"null", b'"x"',
                                                                        b"1", b""])))
    return body


header_value = st.one_of(
    st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20).map(str.encode),
    st.binary(max_size=12).filter(lambda b: b"\r" not in b and b"\n" not in b),
)
# mostly a good key (by either header), sometimes a bad one, none, or junk
auth = st.sampled_from(["good"] * 6 + ["free", "x-api-key", "bad", "none", "junk"])
headers = st.fixed_dictionaries(
    {},
    optional={
        b"x-api-key": st.one_of(st.sampled_from([b"sk-acme", b"sk-nope"]), header_value),
        b"x-qos-class": st.one_of(st.sampled_from([b"realtime", b"REALTIME", b"Batch", b"gold"]),
                                  header_value),
        b"x-qos-priority": st.one_of(st.sampled_from([b"0", b"3", b"-7", b"99999999999999999999",
                                                      b"1_0", b" 2 "]), header_value),
        b"content-type": st.sampled_from([b"application/json", b"text/plain", b""]),
    },
)


# ---------------------------------------------------------------------- one exchange
def exchange(port: int, path: bytes, hdrs: dict[bytes, bytes], body: bytes,
             chunked: bool) -> tuple[int, dict[bytes, bytes], bytes] | None:
    """The response, or None if the server reset the connection before it was read (it
    refused the request while the client was still sending it)."""
    head = [b"POST " + path + b" HTTP/1.1", b"Host: gw", b"Connection: close"]
    head += [k + b": " + v for k, v in hdrs.items()]
    if chunked:
        head.append(b"Transfer-Encoding: chunked")
        mid = len(body) // 2
        payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:mid], body[mid:]) if p)
        payload += b"0\r\n\r\n"
    else:
        head.append(b"Content-Length: %d" % len(body))
        payload = body
    raw = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        try:
            s.sendall(b"\r\n".join(head) + b"\r\n\r\n" + payload)
            while chunk := s.recv(1 << 16):
                raw += chunk
        except (ConnectionResetError, BrokenPipeError):
            if not raw:
                return None
    status_line, _, rest = raw.partition(b"\r\n")
    status = int(status_line.split()[1])
    head_block, _, data = rest.partition(b"\r\n\r\n")
    hs: dict[bytes, bytes] = {}
    for line in head_block.split(b"\r\n"):
        k, _, v = line.partition(b":")
        hs[k.strip().lower()] = v.strip()
    if hs.get(b"transfer-encoding") == b"chunked":
        data = dechunk(data)
    return status, hs, data


def dechunk(data: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, data = data.partition(b"\r\n")
        n = int(size_line, 16)
        if n == 0:
            return out
        out += data[:n]
        data = data[n + 2 :]


def check_error(body: bytes) -> None:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and isinstance(err["code"], str)
    assert err["param"] is None or isinstance(err["param"], str)


def check_response(status: int, hs: dict[bytes, bytes], body: bytes) -> None:
    assert status < 500, (status, body[:500])
    if status >= 400:
        check_error(body)
        assert hs.get(b"content-length") == str(len(body)).encode()
        return
    assert status == 200
    if hs.get(b"content-type", b"").startswith(b"text/event-stream"):
        events = re.findall(rb"^data: (.*)$", body, re.M)
        assert events and events[-1] == b"[DONE]", body[-300:]
        for e in events[:-1]:
            obj = json.loads(e)
            if "error" in obj:  # a stream that had to end early says why
                check_error(e)
    else:
        assert hs.get(b"content-length") == str(len(body)).encode()
        assert json.loads(body)["choices"]


# ---------------------------------------------------------------------- the suite
def with_auth(how: str, hdrs: dict[bytes, bytes], junk: bytes) -> dict[bytes, bytes]:
    out = dict(hdrs)
    if how == "good":
        out[b"authorization"] = b"Bearer sk-acme"
    elif how == "free":
        out[b"authorization"] = b"bearer  sk-free "
    elif how == "x-api-key":
        out.pop(b"authorization", None)
        out[b"x-api-key"] = b"sk-acme"
    elif how == "bad":
        out[b"authorization"] = b"Bearer sk-nope"
    elif how == "junk":
        out[b"authorization"] = junk
    return out


@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture,
                                 HealthCheck.large_base_example])
@given(
    path=st.sampled_from([b"/v1/chat/completions", b"/v1/chat/completions", b"/v1/completions"]),
    how=auth,
    junk=header_value,
    hdrs=headers,
    body=bodies(),
    chunked=st.booleans(),
)
def test_fuzz_http_surface(gw: Server, path: bytes, how: str, junk: bytes,
                           hdrs: dict[bytes, bytes], body: bytes, chunked: bool) -> None:
    hdrs = with_auth(how, hdrs, junk)
    requests, refused, too_large = counts(gw)
    got = exchange(gw.port, path, hdrs, body, chunked)
    if got is not None:
        check_response(*got)
        event(f"status {got[0]}")
    else:
        event("reset")
    # exactly once (a stream's outcome is recorded as its last bytes leave)
    assert wait_until(lambda: counted(gw) == requests + refused + 1, 5), (counts(gw), requests,
                                                                          refused)
    if got is None:
        # a reset only for what the gateway refused before reading it all: not HTTP, or a
        # body over the limit (answered 413 at once, while the client was still sending)
        _, refused_after, too_large_after = counts(gw)
        assert refused_after == refused + 1 or too_large_after == too_large + 1


def test_still_serving_after_the_fuzz(gw: Server) -> None:
    # after the fuzz, one request of each kind of refusal (whether or not the fuzz's examples
    # happened to hit it) is still answered, and counted under its own reason
    key = {"Authorization": "Bearer sk-acme"}
    deep = b"[" * 1000 + b"]" * 1000
    for body_ in (
        b'{"messages": [',  # invalid_json
        b'{"messages": 5}',  # invalid_body
        b'{"model":"\xff","messages":[{"role":"user","content":"x"}]}',  # invalid_utf8
        b'{"messages":[{"role":"user","content":"x"}],"tools":' + deep + b"}",  # json_too_deep
        b'{"priority":1,"pr\\u0069ority":2,"messages":[{"role":"user","content":"x"}]}',
    ):
        code, _, _ = http("POST", gw.url + "/v1/chat/completions", body_, key)
        assert code == 400, body_[:40]
    code, _, _ = http("POST", gw.url + "/v1/chat/completions", b"{}",
                      {"Authorization": "Bearer sk-nope"})
    assert code == 401
    _, _, body = http("GET", gw.url + "/metrics", headers=ADMIN)
    reasons = {dict(k)["reason"] for k in metric_values(body.decode(), "qosgate_requests_total")}
    assert {"completed", "invalid_json", "invalid_body", "invalid_utf8", "json_too_deep",
            "duplicate_key", "invalid_api_key"} <= reasons, reasons
    code, _, out = http("POST", gw.url + "/v1/chat/completions",
                        json.dumps({"messages": [{"role": "user", "content": "hi"}]}).encode(),
                        {"Authorization": "Bearer sk-acme"})
    assert code == 200, out
    assert json.loads(out)["usage"]["completion_tokens"] == 4
    assert http("GET", gw.url + "/readyz")[0] == 200
    assert gw.proc.poll() is None
    assert "Traceback" not in gw.log.read_text()
