"""Nothing gets past the gateway, nothing crashes it: the output cap as asked, duplicate keys,
/metrics access, slow or oversized connections, malformed HTTP, honest 400s in upstream mode,
streams while queued and at shutdown, start-up, config validation, the API key flag; each against
a real gateway process (the simulated engine, or the vLLM stand-in for upstream mode). What the
app alone answers (malformed and deeply nested bodies, type errors and limits, what users reach
for) is tested in this process: ``tests/server/test_abuse.py``.

An unreachable upstream at start-up and upstream errors passed through belong to the upstream
client and are tested with it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from qosgate.core.queueing.engine_order import band_of
from tests.support.answers import CHAT, HI, MALFORMED, TENANTS, is_openai_error, post
from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.ports import free_port
from tests.support.processes import MODEL, QOSGATE, Server, gateway_args, start_gateway
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

SIM = "qosgate-sim"



def write(tmp: Path, name: str, text: str) -> Path:
    p = tmp / name
    p.write_text(text)
    return p


def outcomes(gw: Server, key: str | None = None) -> dict[tuple[tuple[str, str], ...], float]:
    headers = {"Authorization": f"Bearer {key}"} if key else None
    _, _, body = http("GET", gw.url + "/metrics", headers=headers)
    return metric_values(body.decode(), "qosgate_requests_total")


def count(gw: Server, reason: str, key: str | None = None, **labels: str) -> float:
    out = 0.0
    for lbls, v in outcomes(gw, key).items():
        d = dict(lbls)
        if d.get("reason") == reason and all(d.get(k) == val for k, val in labels.items()):
            out += v
    return out


def refused_conns(gw: Server, reason: str) -> float:
    _, _, body = http("GET", gw.url + "/metrics", headers={"Authorization": "Bearer sk-admin"})
    vals = metric_values(body.decode(), "qosgate_connections_refused_total")
    return vals.get((("reason", reason),), 0.0)


def recorded(standin: Server) -> list[dict[str, Any]]:
    _, _, body = http("GET", standin.url + "/debug/requests")
    return [json.loads(base64.b64decode(r["body"])) for r in json.loads(body)["requests"]]


def raw_request(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection and read until the server closes it."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, TimeoutError):
                break
            if not chunk:
                break
            out += chunk
        return out


# ---------------------------------------------------------------------- gateways
@pytest.fixture(scope="module")
def guarded_gw(tmp_session: Path) -> Iterator[Server]:
    cfg = write(tmp_session, "abuse-metrics.yaml", TENANTS + """
server:
  admin_keys: [sk-admin]
  metrics_auth: true
  metrics_max_tenants: 2
  sse_keepalive_s: 0.2
# a 500-token stream holds the slot seconds
engine: {kind: sim, time_scale: 0.5, max_window: 1, eos_after: 8}
""")
    gw = start_gateway(tmp_session, "--config", str(cfg))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def up_gw(standin: Server, tmp_session: Path) -> Iterator[Server]:
    cfg = write(tmp_session, "abuse-up.yaml", TENANTS + f"""
server: {{admin_keys: [sk-admin]}}
upstreams: [{{url: {standin.url}, name: standin, max_window: 4, priority_polarity: vllm}}]
""")
    gw = start_gateway(tmp_session, "--config", str(cfg))
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def guard_gw(tmp_session: Path) -> Iterator[Server]:
    cfg = write(tmp_session, "abuse-guard.yaml", """
server: {header_timeout_s: 0.5, body_timeout_s: 0.5, max_connections: 6,
         max_header_bytes: 4096}
engine: {kind: sim, time_scale: 0.02}
""")
    gw = start_gateway(tmp_session, "--config", str(cfg))
    yield gw
    gw.stop()


# ---------------------------------------------------------------------- max_tokens cap
def test_no_max_tokens_is_forwarded_as_none(up_gw: Server, standin: Server) -> None:
    """What the client asked is what the engine gets: no cap stays none (an explicit null
    stays null), and max_completion_tokens is not joined by a max_tokens."""
    for body, has in (
        ({"model": MODEL, "messages": HI}, False),
        ({"model": MODEL, "messages": HI, "max_tokens": None}, True),
    ):
        code, hdrs, out = post(up_gw, json.dumps(body).encode())
        assert code == 200, out
        sent = recorded(standin)[-1]
        assert sent["messages"] == HI and sent.get("max_tokens") is None, sent
        assert ("max_tokens" in sent) is has
        # the stand-in's model ends its answer by itself: "stop", not a cap's "length"
        assert json.loads(out)["choices"][0]["finish_reason"] == "stop"
        assert "x-qosgate-inserted-max-tokens" not in hdrs
    code, _, out = post(up_gw, json.dumps(
        {"model": MODEL, "messages": HI, "max_completion_tokens": 5}).encode())
    assert code == 200, out
    sent = recorded(standin)[-1]
    assert sent["max_completion_tokens"] == 5 and "max_tokens" not in sent


def test_max_completion_tokens_is_checked_like_max_tokens(up_gw: Server) -> None:
    code, _, out = post(up_gw, json.dumps(
        {"model": MODEL, "messages": HI, "max_completion_tokens": 9000}).encode())
    err = is_openai_error(out)
    assert code == 400 and err["code"] == "invalid_max_tokens"
    assert err["param"] == "max_completion_tokens" and "500" in err["message"]
    code, _, out = post(up_gw, json.dumps(
        {"model": MODEL, "messages": HI, "max_tokens": 10, "max_completion_tokens": 0}).encode())
    assert code == 400 and is_openai_error(out)["param"] == "max_completion_tokens"


# ---------------------------------------------------------------------- duplicate keys
@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b'{"model":"M","messages":MSG,"priority":3,"pr\\u0069ority":-100}', "priority"),
        (b'{"model":"M","messages":MSG,"priority":3,"priority":-100}', "priority"),
        (b'{"model":"M","messages":MSG,"max_tokens":5,"max_tokens":null}', "max_tokens"),
        (b'{"model":"M","messages":MSG,"m\\u0061x_tokens":9}', "max_tokens"),
        (b'{"model":"M","messages":MSG,"messages":MSG}', "messages"),
        (b'{"model":"M","messages":MSG,"model":"M"}', "model"),
    ],
)
def test_duplicate_or_escaped_keys_the_gateway_acts_on_are_refused(
    up_gw: Server, standin: Server, body: bytes, param: str
) -> None:
    body = body.replace(b"MSG", json.dumps(HI).encode()).replace(b'"M"', json.dumps(MODEL).encode())
    before = len(recorded(standin))
    n = count(up_gw, "duplicate_key")
    code, _, out = post(up_gw, body, key="sk-clamped")
    err = is_openai_error(out)
    assert code == 400 and err["code"] == "duplicate_key" and err["param"] == param
    assert len(recorded(standin)) == before  # nothing reached the engine
    assert count(up_gw, "duplicate_key") == n + 1


def test_the_engine_reads_the_priority_the_gateway_decided(up_gw: Server,
                                                             standin: Server) -> None:
    # a tenant clamped to batch/offline asking for realtime: the engine sees band 2 (batch;
    # qosgate's order value, core.queueing.engine_order), whatever else the body says about
    # priority in nested members
    body = {"model": MODEL, "messages": HI, "priority": 0, "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"priority": {"type": "integer"}}}}}]}
    code, _, out = post(up_gw, json.dumps(body).encode(), key="sk-clamped")
    assert code == 200, out
    sent = recorded(standin)[-1]
    assert band_of(sent["priority"]) == 2
    assert sent["tools"] == body["tools"]


# ---------------------------------------------------------------------- /metrics
def test_metrics_need_the_admin_key_when_configured(guarded_gw: Server) -> None:
    gw = guarded_gw
    code, _, out = http("GET", gw.url + "/metrics")
    assert code == 401 and is_openai_error(out)["code"] == "invalid_api_key"
    code, _, _ = http("GET", gw.url + "/metrics", headers={"Authorization": "Bearer sk-acme"})
    assert code == 401
    code, _, body = http("GET", gw.url + "/metrics", headers={"x-api-key": "sk-admin"})
    assert code == 200 and b"qosgate_requests_total" in body


def test_tenant_labels_on_metrics_are_capped(guarded_gw: Server) -> None:
    gw = guarded_gw
    for key in ("sk-acme", "sk-beta", "sk-gamma", "sk-clamped"):
        code, _, out = post(gw, json.dumps({"messages": HI, "max_tokens": 1}).encode(), key)
        assert code == 200, out
    tenants = {dict(k).get("tenant") for k in outcomes(gw, "sk-admin")}
    assert {"acme", "beta", "other"} <= tenants
    assert not tenants & {"gamma", "clamped"}
    ok = {k: v for k, v in outcomes(gw, "sk-admin").items()
          if ("reason", "completed") in k and ("tenant", "other") in k}
    assert sum(ok.values()) >= 2


def test_metrics_on_a_port_of_their_own(tmp_session: Path) -> None:
    mport = free_port()
    gw = start_gateway(tmp_session, "--engine", "sim", "--metrics-port", str(mport))
    try:
        assert http("GET", gw.url + "/metrics")[0] == 404
        code, _, body = http("GET", f"http://127.0.0.1:{mport}/metrics")
        assert code == 200 and b"qosgate_requests_total" in body
        assert http("POST", f"http://127.0.0.1:{mport}{CHAT}", b"{}")[0] == 404
        assert f"/metrics on http://127.0.0.1:{mport}/metrics" in gw.log.read_text()
    finally:
        gw.stop()


# ---------------------------------------------------------------------- slowloris
def test_a_silent_connection_is_closed_at_the_header_timeout(guard_gw: Server) -> None:
    n = refused_conns(guard_gw, "header_timeout")
    t0 = time.monotonic()
    assert raw_request(guard_gw.port, b"") == b""  # nothing sent: closed, nothing answered
    assert 0.4 < time.monotonic() - t0 < 4
    assert wait_until(lambda: refused_conns(guard_gw, "header_timeout") == n + 1)


def test_half_a_head_gets_408(guard_gw: Server) -> None:
    n = refused_conns(guard_gw, "header_timeout")
    out = raw_request(guard_gw.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and is_openai_error(body)["code"] == "header_timeout"
    assert refused_conns(guard_gw, "header_timeout") == n + 1


def _upload_head(size: int) -> bytes:
    return (b"POST /v1/files HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: multipart/form-data; boundary=B\r\n"
            b"Content-Length: " + str(size).encode() + b"\r\n\r\n")


def test_an_upload_slower_than_the_body_timeout_is_timed_between_its_chunks(
        guard_gw: Server) -> None:
    line = json.dumps({"custom_id": "a", "method": "POST", "url": "/v1/completions",
                       "body": {"model": "m", "prompt": "x"}}).encode() + b"\n"
    body = (b'--B\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--B\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"\r\n'
            b"Content-Type: application/jsonl\r\n\r\n" + line * 4 + b"\r\n--B--\r\n")
    pieces = [body[i:i + len(body) // 4 + 1] for i in range(0, len(body), len(body) // 4 + 1)]
    with socket.create_connection(("127.0.0.1", guard_gw.port), timeout=5) as s:
        s.sendall(_upload_head(len(body)))
        for piece in pieces:  # 4 x 0.3 s: longer in all than the 0.5 s body timeout
            time.sleep(0.3)
            s.sendall(piece)
        out = b""
        while b"\r\n\r\n" not in out or len(out.partition(b"\r\n\r\n")[2]) < int(
                re.search(rb"(?i)content-length: (\d+)", out).group(1)):  # type: ignore[union-attr]
            chunk = s.recv(65536)
            assert chunk, out
            out += chunk
    head, _, answer = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), out
    assert json.loads(answer)["object"] == "file"
    # a silent upload still ends at the body timeout
    out = raw_request(guard_gw.port, _upload_head(len(body)) + pieces[0])
    head, _, answer = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and is_openai_error(answer)["code"] == "body_timeout"


def test_half_a_body_gets_408_and_is_the_requests_outcome(guard_gw: Server) -> None:
    n = count(guard_gw, "body_timeout")
    out = raw_request(guard_gw.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: 100\r\n\r\n{\"prompt\": \"x")
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and is_openai_error(body)["code"] == "body_timeout"
    assert count(guard_gw, "body_timeout", outcome="rejected") == n + 1


def test_headers_over_the_cap_get_431(guard_gw: Server) -> None:
    out = raw_request(guard_gw.port, b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 8000)
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431")
    assert is_openai_error(body)["code"] == "headers_too_large"


def test_connections_over_the_cap_get_503(guard_gw: Server) -> None:
    n = refused_conns(guard_gw, "too_many_connections")
    idle = [socket.create_connection(("127.0.0.1", guard_gw.port)) for _ in range(6)]
    try:
        out = raw_request(guard_gw.port, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"retry-after: 1" in head.lower()
        assert is_openai_error(body)["code"] == "too_many_connections"
    finally:
        for s in idle:
            s.close()
    # the idle ones time out or close; the gateway serves again
    assert wait_until(lambda: http("GET", guard_gw.url + "/healthz")[0] == 200, 5)
    assert refused_conns(guard_gw, "too_many_connections") >= n + 1


def test_malformed_http_is_an_openai_400(guard_gw: Server) -> None:
    n = refused_conns(guard_gw, "invalid_http")
    out = raw_request(guard_gw.port, b"GET / HTTP/1.1\r\nBad Header\x01: x\r\n\r\n")
    head, _, body = out.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and is_openai_error(body)["code"] == "invalid_http"
    assert refused_conns(guard_gw, "invalid_http") == n + 1


# ---------------------------------------------------------------------- honest 400s
@pytest.mark.parametrize("messages", MALFORMED)
def test_malformed_messages_are_400_upstream(up_gw: Server, standin: Server,
                                              messages: bytes) -> None:
    before = len(recorded(standin))
    code, _, out = post(up_gw, b'{"max_tokens":1,"messages":' + messages + b"}")
    assert code == 400 and is_openai_error(out)["param"].startswith("messages")
    assert len(recorded(standin)) == before


# ---------------------------------------------------------------------- streams and start-up
def test_a_queued_stream_gets_its_head_and_keep_alives(guarded_gw: Server) -> None:
    c = OpenAI(base_url=guarded_gw.url + "/v1", api_key="sk-acme", max_retries=0)
    hold = c.chat.completions.create(model=SIM, messages=HI, max_tokens=500, stream=True)
    it = iter(hold)
    next(it)  # the one slot (window 1) is taken
    try:
        with socket.create_connection(("127.0.0.1", guarded_gw.port), timeout=10) as s:
            body = json.dumps({"messages": HI, "max_tokens": 2, "stream": True}).encode()
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Authorization: Bearer sk-acme\r\nContent-Length: %d\r\n\r\n" % len(body)
                      + body)
            got = b""
            while got.count(b": keep-alive") < 2:
                chunk = s.recv(4096)
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 200") and b"text/event-stream" in got
            assert b"data:" not in got  # still queued: no token yet
    finally:
        hold.close()


def test_streams_cut_at_the_shutdown_timeout_end_with_an_error_and_done(
    tmp_session: Path,
) -> None:
    gw = start_gateway(tmp_session, "--engine", "sim", "--shutdown-timeout", "0.5")
    try:
        with socket.create_connection(("127.0.0.1", gw.port), timeout=10) as s:
            body = json.dumps({"prompt": "x", "max_tokens": 5000, "stream": True}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            got = b""
            while b"data:" not in got:
                chunk = s.recv(65536)
                assert chunk, got
                got += chunk
            gw.proc.send_signal(signal.SIGTERM)
            while not got.endswith(b"0\r\n\r\n"):  # the chunked response's end
                chunk = s.recv(65536)
                assert chunk, got[-300:]
                got += chunk
        events = re.findall(rb"data: [^\n]*", got)
        assert events[-1] == b"data: [DONE]"
        err = json.loads(events[-2][6:])["error"]
        assert err["code"] == "server_shutdown"
        assert gw.proc.wait(10) == 0
        log = gw.log.read_text()
        assert "CancelledError" not in log and "Traceback" not in log
    finally:
        gw.stop()


def test_the_port_is_bound_before_the_model_loads(tmp_session: Path) -> None:
    bogus = write(tmp_session, "bogus.gguf", "not a model")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the model cannot load: had it been loaded first, that would be the error
        r = subprocess.run(gateway_args(port, "--model", str(bogus)),
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "cannot listen" in r.stdout and "cannot start the engine" not in r.stdout


def test_serving_on_names_the_bound_port(tmp_session: Path) -> None:
    log = tmp_session / "port0.log"
    with log.open("wb") as f:
        proc = subprocess.Popen([*QOSGATE, "serve", "--engine", "sim", "--port", "0"],
                                stdout=f, stderr=subprocess.STDOUT)
    try:
        assert wait_until(lambda: "serving on" in log.read_text(), 30)
        line = next(ln for ln in log.read_text().splitlines() if "serving on" in ln)
        port = int(line.split("serving on http://127.0.0.1:")[1].split()[0])
        assert port != 0 and http("GET", f"http://127.0.0.1:{port}/health")[0] == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)


# ---------------------------------------------------------------------- qosgate config
@pytest.mark.parametrize(
    "section",
    [
        "server: {prot: 8000}",
        "server: {port: 99999}",
        "upstreams: [{url: localhost:8001}]",
        "upstreams: [{url: 'http://a:1', capacty: 3}]",
        "engine: {kind: vllm}",
        "engine: {kind: sim, profile: no-such-profile}",
        "server: {default_max_tokens: 256}",
        "server: {metrics_auth: true}",
    ],
)
def test_qosgate_config_validates_every_section(tmp_session: Path, section: str) -> None:
    p = write(tmp_session, "bad.yaml", section + "\n")
    r = subprocess.run([*QOSGATE, "config", "--config", str(p)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2, r.stdout


def test_the_api_key_flag_admits_that_key_alone_by_either_header(tmp_session: Path) -> None:
    gw = start_gateway(tmp_session, "--engine", "sim", "--api-key", "sk-one")
    try:
        body = json.dumps({"messages": HI, "max_tokens": 1}).encode()
        assert http("POST", gw.url + CHAT, body)[0] == 401
        assert http("POST", gw.url + CHAT, body, {"Authorization": "Bearer sk-two"})[0] == 401
        assert http("POST", gw.url + CHAT, body, {"Authorization": "Bearer sk-one"})[0] == 200
        assert http("POST", gw.url + CHAT, body, {"x-api-key": "sk-one"})[0] == 200
        assert "running OPEN" not in gw.log.read_text()
    finally:
        gw.stop()


def test_serve_help_lists_the_choices_and_refuses_others() -> None:
    r = subprocess.run([*QOSGATE, "serve", "--help"], capture_output=True, text=True,
                       timeout=60, env=dict(os.environ, COLUMNS="200"))
    out = r.stdout
    assert r.returncode == 0
    for choices in ("llamacpp|sim", "fifo|priority|wfq|qos", "vllm|sglang|none",
                    "critical|error|warning|info|debug"):
        assert choices in out, choices
    r = subprocess.run([*QOSGATE, "serve", "--engine", "vllm"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2


def test_a_queued_upstream_stream_gets_keep_alives_then_its_tokens(standin: Server,
                                                                      tmp_session: Path) -> None:
    """The same through the upstream client's relay: after the early head, the engine's stream
    follows on the same response, whole."""
    cfg = write(tmp_session, "abuse-ka-up.yaml", f"""
server: {{sse_keepalive_s: 0.2}}
fleet: {{window: {{mode: fixed}}}}
upstreams: [{{url: {standin.url}, name: standin, max_window: 1, priority_polarity: vllm}}]
""")
    gw = start_gateway(tmp_session, "--config", str(cfg))
    try:
        c = OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=60)
        hold = c.chat.completions.create(model=MODEL, messages=HI, max_tokens=2000, stream=True)
        it = iter(hold)
        next(it)
        with socket.create_connection(("127.0.0.1", gw.port), timeout=30) as s:
            body = json.dumps({"model": MODEL, "messages": HI, "max_tokens": 5,
                               "stream": True}).encode()
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            got = b""
            while got.count(b": keep-alive") < 2:
                chunk = s.recv(4096)
                assert chunk, got
                got += chunk
            assert b"data:" not in got
            hold.close()  # the slot frees: the queued stream runs
            while not got.endswith(b"0\r\n\r\n"):
                chunk = s.recv(65536)
                assert chunk, got[-300:]
                got += chunk
        assert got.count(b"HTTP/1.1 200") == 1
        events = re.findall(rb"data: ([^\n]*)", got)
        assert events[-1] == b"[DONE]"
        text = "".join(json.loads(e)["choices"][0]["delta"].get("content") or ""
                       for e in events[:-1] if json.loads(e)["choices"])
        assert len(text.split()) == 5
    finally:
        gw.stop()
