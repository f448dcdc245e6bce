"""SIGTERM drains: the listener stays open (/readyz 503), requests not begun get 503 at once,
running ones finish, then exit 0; a second signal exits at once; SIGHUP without a config file is
a refused reload."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import MODEL, Server, start_gateway, start_standin
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e


def test_sigterm_drains_gracefully(standin: Server, tmp_session: Path) -> None:
    gw = start_gateway(tmp_session, "--upstream", standin.url, "--upstream-capacity", "1",
                       "--shutdown-timeout", "20")
    try:
        c = OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
        running = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=120, stream=True
        )
        it = iter(running)
        first = [next(it)]
        errors: list[BaseException] = []

        def queued() -> None:
            try:
                c.completions.create(model=MODEL, prompt="x", max_tokens=2)
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=queued) for _ in range(2)]
        for th in threads:
            th.start()
        # both queued behind the running stream (waited for: on a loaded machine a thread's
        # connection could come after the signal, and be refused instead of answered 503)
        assert wait_until(lambda: metric_values(
            http("GET", gw.url + "/metrics")[2].decode(), "qosgate_queue_depth"
        ).get((("class", "api"),), 0.0) == 2, 10)
        t0 = time.monotonic()
        gw.proc.send_signal(signal.SIGTERM)
        for th in threads:
            th.join(5)
        assert time.monotonic() - t0 < 2.0
        assert len(errors) == 2
        for e in errors:
            assert isinstance(e, openai.InternalServerError) and e.status_code == 503
            assert e.code == "shutting_down" and e.response.headers["retry-after"].isdigit()
        chunks = first + list(it)  # the running request finishes whole
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert len(text.split()) == 120 and chunks[-1].choices[0].finish_reason == "length"
        assert gw.proc.wait(10) == 0
        with pytest.raises(OSError):
            http("GET", gw.url + "/healthz", timeout=1)
    finally:
        gw.stop()


def _standin_gauge(standin: Server, name: str) -> float:
    return sum(metric_values(http("GET", standin.url + "/metrics")[2].decode(), name).values())


def _completion_body(max_tokens: int) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "x", "max_tokens": max_tokens}).encode()


class _Events:
    """What the test saw, in the order it saw it (threads append; ``list.append`` is atomic)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def add(self, what: str) -> None:
        self.seen.append(what)

    def index(self, what: str) -> int:
        return self.seen.index(what)


def _poll_readyz(url: str, events: _Events, stop: threading.Event) -> None:
    """``/readyz`` polled until the gateway no longer takes connections (or the test ends)."""
    while not stop.is_set():
        try:
            status, _, _ = http("GET", url + "/readyz", timeout=5)
        except OSError:
            events.add("readyz refused")
            return
        events.add(f"readyz {status}")
        stop.wait(0.02)  # a probe's pace, not a wait for a condition


def test_drain_sequence_as_a_rollout_drives_it(tmp_session: Path) -> None:
    """SIGTERM (what Kubernetes sends after preStop) with a stream running, a request sent to
    the engine but waiting in its queue, and one queued at the gateway: the listener stays open
    with /readyz 503, everything not begun is answered 503 at once (the engine's waiting one too,
    aborted there), the stream finishes, then the listener closes and the process exits 0."""
    engine = start_standin(tmp_session, "--max-num-seqs", "1")  # a second request waits there
    # a window of 3: two for api, one kept for realtime (its reserve)
    gw = start_gateway(tmp_session, "--upstream", engine.url, "--max-window", "3",
                       "--shutdown-timeout", "60", "--log-level", "info")
    events = _Events()
    stop_polling = threading.Event()
    poller = threading.Thread(target=_poll_readyz, args=(gw.url, events, stop_polling))
    try:
        poller.start()
        assert wait_until(lambda: "readyz 200" in events.seen, 10)
        c = OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=60)
        stream = iter(c.completions.create(model=MODEL, prompt="x", max_tokens=400, stream=True))
        chunks = [next(stream)]

        def read_stream() -> None:
            chunks.extend(stream)
            events.add("stream ended")

        answers: dict[str, tuple[int, dict[str, str], bytes]] = {}

        def send(name: str) -> None:
            answers[name] = http("POST", gw.url + "/v1/completions", _completion_body(2),
                                 {"content-type": "application/json"}, timeout=60)
            events.add(f"{name} answered")

        at_engine = threading.Thread(target=send, args=("at engine",))
        at_engine.start()
        assert wait_until(lambda: _standin_gauge(engine, "vllm:num_requests_waiting") == 1, 10)
        queued = threading.Thread(target=send, args=("queued",))
        queued.start()
        assert wait_until(lambda: metric_values(
            http("GET", gw.url + "/metrics")[2].decode(), "qosgate_queue_depth"
        ).get((("class", "api"),), 0.0) == 1, 10)
        reader = threading.Thread(target=read_stream)
        reader.start()

        events.add("SIGTERM")
        gw.proc.send_signal(signal.SIGTERM)
        at_engine.join(30)
        queued.join(30)
        for name in ("at engine", "queued"):
            status, headers, body = answers[name]
            assert status == 503 and headers["retry-after"].isdigit(), (name, answers[name])
            assert json.loads(body)["error"]["code"] == "shutting_down"
        # aborted at the engine: it no longer waits there; the stream still runs
        assert wait_until(lambda: _standin_gauge(engine, "vllm:num_requests_waiting") == 0, 10)
        # draining: connections are still taken; not ready, but alive
        status, _, body = http("GET", gw.url + "/readyz")
        assert status == 503 and json.loads(body) == {"status": "draining"}
        assert http("GET", gw.url + "/health")[0] == 200
        status, headers, body = http("POST", gw.url + "/v1/completions", _completion_body(2),
                                     {"content-type": "application/json"})
        assert status == 503 and headers["retry-after"].isdigit()
        assert json.loads(body)["error"]["code"] == "shutting_down"
        events.add("new request refused")
        # each of the three counted once, as refused for the shutdown; the stream not yet
        counted = metric_values(http("GET", gw.url + "/metrics")[2].decode(),
                                "qosgate_requests_total")
        assert sum(counted.values()) == 3
        assert {dict(k)["reason"] for k, v in counted.items() if v} == {"shutting_down"}

        reader.join(60)
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert len(text.split()) == 400 and chunks[-1].choices[0].finish_reason == "length"
        assert gw.proc.wait(30) == 0
        poller.join(30)
        seen = events.seen
        # the waiting requests were answered while the stream still ran, before it ended
        assert events.index("SIGTERM") < events.index("at engine answered")
        assert events.index("at engine answered") < events.index("stream ended")
        assert events.index("queued answered") < events.index("stream ended")
        assert events.index("new request refused") < events.index("stream ended")
        # /readyz: 200 before, then 503 (never 200 again), and refused only once it ended
        polls = [e for e in seen if e.startswith("readyz")]
        first_503 = polls.index("readyz 503")
        assert set(polls[:first_503]) == {"readyz 200"}
        assert polls[first_503:-1] == ["readyz 503"] * (len(polls) - first_503 - 1)
        assert polls[-1] == "readyz refused"
        assert events.index("readyz refused") > events.index("stream ended")
        assert events.index("readyz 200") < events.index("SIGTERM")
    finally:
        stop_polling.set()
        gw.stop()
        engine.stop()


def test_sighup_without_a_config_file_is_a_refused_reload_and_serving_goes_on(
    standin: Server, tmp_session: Path
) -> None:
    """SIGHUP reloads the config file (``tests/e2e/test_reload.py``); a gateway started without
    one has nothing to reload: it says so and serves on (a hang-up never takes it down)."""
    gw = start_gateway(tmp_session, "--upstream", standin.url)
    try:
        gw.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "started without a config file" in gw.log.read_text(), 10)
        assert gw.proc.poll() is None
        assert http("GET", gw.url + "/readyz")[0] == 200
        status, _, _ = http("POST", gw.url + "/v1/completions", _completion_body(2),
                            {"content-type": "application/json"})
        assert status == 200
    finally:
        assert gw.stop() == 0


def test_second_signal_exits_at_once_without_a_traceback(standin: Server,
                                                          tmp_session: Path) -> None:
    gw = start_gateway(tmp_session, "--upstream", standin.url, "--shutdown-timeout", "60")
    try:
        c = OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=60)
        stream = iter(c.completions.create(model=MODEL, prompt="x", max_tokens=2000,
                                           stream=True))
        next(stream)
        gw.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: http("GET", gw.url + "/readyz")[0] == 503, 10)
        gw.proc.send_signal(signal.SIGINT)  # a second Ctrl+C
        assert gw.proc.wait(10) == 130
        log = gw.log.read_text()
        assert "Traceback" not in log
        assert log.count("second SIGINT: exiting now") == 1
    finally:
        gw.stop()


def test_drain_delay_serves_while_readyz_says_draining(standin: Server,
                                                       tmp_session: Path) -> None:
    """``server.drain_delay_s``: after SIGTERM, /readyz is 503 at once while requests are still
    served. The delay is far longer than the test, so the 200 cannot race its end."""
    cfg = tmp_session / "drain-delay-long.yaml"
    cfg.write_text("server: {drain_delay_s: 600}\n")
    gw = start_gateway(tmp_session, "--upstream", standin.url, "--config", str(cfg))
    try:
        gw.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: http("GET", gw.url + "/readyz")[0] == 503, 10)
        status, _, _ = http("POST", gw.url + "/v1/completions", _completion_body(2),
                            {"content-type": "application/json"})
        assert status == 200  # still served: the delay is on (the drain would answer 503)
    finally:
        gw.stop()


def test_the_drain_begins_once_the_delay_is_over(standin: Server, tmp_session: Path) -> None:
    """Once ``server.drain_delay_s`` is over the drain answers 503 ``shutting_down``, and the
    gateway exits 0 once its running stream is done. The stream keeps the drain open (a drain
    with nothing running closes the listener at once, before a poll could see its 503): its
    tokens take far longer than the delay."""
    cfg = tmp_session / "drain-delay-short.yaml"
    cfg.write_text("server: {drain_delay_s: 0.5, shutdown_timeout_s: 120}\n")
    gw = start_gateway(tmp_session, "--upstream", standin.url, "--config", str(cfg))
    try:
        c = OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=120)
        running = iter(c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2000,
            stream=True))
        next(running)
        gw.proc.send_signal(signal.SIGTERM)
        assert wait_until(lambda: http("POST", gw.url + "/v1/completions", _completion_body(2),
                                       {"content-type": "application/json"})[0] == 503, 10)
        finish = [ch.choices[0].finish_reason for ch in running if ch.choices]
        assert finish[-1] == "length"
        assert gw.proc.wait(30) == 0
    finally:
        gw.stop()
