"""The stand-in's fault switches over real sockets: command-line flags and the admin endpoint."""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.httpclient import http
from tests.support.processes import Server, start_standin
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

STEP_FIXED_S = 0.00685  # the default profile's fixed step time: a step lasts at least this


def faults(s: Server) -> dict[str, Any]:
    code, _, body = http("GET", s.url + "/admin/fault")
    assert code == 200, body
    return dict(json.loads(body))


def switch(s: Server, doc: dict[str, Any]) -> dict[str, Any]:
    code, _, body = http("POST", s.url + "/admin/fault", json.dumps(doc).encode())
    assert code == 200, body
    return dict(json.loads(body))


def completion(s: Server, max_tokens: int = 2, stream: bool = False,
               timeout: float = 10) -> tuple[int, dict[str, str], bytes]:
    body = json.dumps({"prompt": "x", "max_tokens": max_tokens, "stream": stream}).encode()
    return http("POST", s.url + "/v1/completions", body, timeout=timeout)


@pytest.fixture
def standin(tmp_path: Path) -> Iterator[Server]:
    s = start_standin(tmp_path, "--time-scale", "0.2")
    yield s
    s.stop()


def test_429_from_the_command_line_with_retry_after_and_a_count(tmp_path: Path) -> None:
    s = start_standin(tmp_path, "--fault", "429:retry-after=2:count=2", "--time-scale", "0.2")
    try:
        for _ in range(2):
            code, headers, body = completion(s)
            assert code == 429 and headers["retry-after"] == "2"
            assert json.loads(body)["error"]["code"] == 429
        assert completion(s)[0] == 200  # the count is used up
        assert http("GET", s.url + "/v1/models")[0] == 200  # health is never affected
        assert faults(s)["hits"] == {"429": 2}
    finally:
        s.stop()


def test_503_switched_on_and_off_at_run_time(standin: Server) -> None:
    out = switch(standin, {"fault": "503", "retry_after": 1.5})
    assert [f["fault"] for f in out["faults"]] == ["503:retry-after=1.5"]
    code, headers, _ = completion(standin)
    assert code == 503 and headers["retry-after"] == "1.5"
    assert http("GET", standin.url + "/health")[0] == 200
    code, _, body = http("DELETE", standin.url + "/admin/fault")
    assert code == 200 and json.loads(body)["faults"] == []
    assert completion(standin)[0] == 200


def test_bad_fault_is_a_400_and_a_bad_flag_a_usage_error(standin: Server, tmp_path: Path) -> None:
    code, _, body = http("POST", standin.url + "/admin/fault", b'{"fault": "explode"}')
    assert code == 400 and "unknown fault" in json.loads(body)["error"]["message"]
    with pytest.raises(RuntimeError, match="unknown fault"):
        start_standin(tmp_path, "--fault", "explode")


def test_hang_before_the_first_byte_keeps_the_connection_silent(standin: Server) -> None:
    switch(standin, {"fault": "hang-first-byte"})
    t0 = time.monotonic()
    with pytest.raises((TimeoutError, urllib.error.URLError)):
        completion(standin, timeout=0.5)
    assert time.monotonic() - t0 >= 0.45
    assert faults(standin)["hits"] == {"hang-first-byte": 1}
    # the engine saw the client leave
    assert wait_until(lambda: json.loads(http("GET", standin.url + "/debug/requests")[2])
                      ["finished"]["abort"] == 1)
    http("DELETE", standin.url + "/admin/fault?kind=hang-first-byte")
    assert completion(standin)[0] == 200


def _read_events(sock: socket.socket, until: float) -> bytes:
    got = b""
    while time.monotonic() < until:
        sock.settimeout(max(0.01, until - time.monotonic()))
        try:
            data = sock.recv(65536)
        except TimeoutError:
            break
        if not data:
            raise AssertionError("the stand-in closed the connection")
        got += data
    return got


def test_hang_mid_stream_after_n_chunks_keeps_the_connection_open(standin: Server) -> None:
    switch(standin, {"fault": "hang-mid-stream:after=3", "count": 1})
    body = json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": 50,
                       "stream": True}).encode()
    with socket.create_connection(("127.0.0.1", standin.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        # 50 tokens at x0.2 speed take ~70 ms: after 1 s the whole stream would be long done
        got = _read_events(sock, time.monotonic() + 1.0)
    assert got.startswith(b"HTTP/1.1 200")
    assert got.count(b'"content":') - got.count(b'"role":') == 3  # 3 content chunks, no more
    assert b"[DONE]" not in got and b"finish_reason\":\"" not in got
    # the count was 1: the next stream is whole
    code, _, out = http("POST", standin.url + "/v1/chat/completions", body)
    assert code == 200 and out.rstrip().endswith(b"data: [DONE]")


def test_slow_multiplies_the_step_time_and_clears(tmp_path: Path) -> None:
    s = start_standin(tmp_path, "--slow", "20")
    try:
        assert faults(s)["time_scale"] == 20.0
        t0 = time.monotonic()
        assert completion(s, max_tokens=10)[0] == 200
        # every step lasts at least its fixed part, x20: 10 decode steps (and a prefill)
        assert time.monotonic() - t0 >= 10 * STEP_FIXED_S * 20
        http("DELETE", s.url + "/admin/fault")
        assert faults(s)["time_scale"] == 1.0
        switch(s, {"fault": "slow", "factor": 3, "for": 0.3})
        assert faults(s)["time_scale"] == 3.0
        assert wait_until(lambda: faults(s)["time_scale"] == 1.0, 3)  # cleared by itself
    finally:
        s.stop()


def test_refuse_for_a_while_then_listen_again(standin: Server) -> None:
    switch(standin, {"fault": "refuse:for=1"})

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", standin.port), timeout=0.5).close()
        except ConnectionRefusedError:
            return True
        return False

    assert wait_until(refused, 2)
    assert wait_until(lambda: http("GET", standin.url + "/health", timeout=0.5)[0] == 200, 5)
    assert completion(standin)[0] == 200


def test_die_kills_the_process_as_kill_9(standin: Server) -> None:
    code, _, _ = http("POST", standin.url + "/admin/fault", b'{"fault": "die"}')
    assert code == 200  # answered first
    assert wait_until(lambda: standin.proc.poll() is not None, 5)
    assert standin.proc.returncode == -signal.SIGKILL


def test_die_after_a_delay_from_the_command_line(tmp_path: Path) -> None:
    s = start_standin(tmp_path, "--fault", "die:after=0.5")
    try:
        assert completion(s)[0] == 200
        assert wait_until(lambda: s.proc.poll() is not None, 5)
        assert s.proc.returncode == -signal.SIGKILL
    finally:
        s.stop()
