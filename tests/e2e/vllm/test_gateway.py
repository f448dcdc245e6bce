"""qosgate (``qosgate serve``, a real process) in front of real vLLM 0.32, through the official
``openai`` client: responses and usage passed through, ``priority`` forwarded in vLLM's polarity
and honoured by vLLM's own queue, the ``none`` polarity in front of an ``fcfs`` vLLM, vLLM's
errors, a client disconnect aborting inside vLLM, vLLM's ``/metrics`` read as load signals, and a
whole answer through the gateway equal to vLLM's own whole answer.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import openai
import pytest

from tests.support.httpclient import http
from tests.support.json_match import same_json
from tests.support.metrics import metric_values
from tests.support.processes import Server
from tests.support.vllm import GHOST, MAX_MODEL_LEN, MAX_NUM_SEQS, MODEL, client, signals, wait_idle
from tests.support.waiting import wait_until

# the first test here may build the environment and start vLLM (minutes on a busy machine)
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

IGNORE_EOS = {"ignore_eos": True}  # vLLM's sampling extra: exactly max_tokens tokens


# ------------------------------------------------------------------ responses and usage
def test_chat_and_completions_with_usage(gw_priority: Server) -> None:
    c = client(gw_priority)
    r = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}], max_tokens=6,
        temperature=0, extra_body=IGNORE_EOS,
    )
    assert r.model == MODEL and r.object == "chat.completion"
    assert (r.system_fingerprint or "").startswith("vllm-0.32.0")  # vLLM answered
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage is not None and r.usage.completion_tokens == 6 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6

    t = c.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=5,
                             temperature=0, extra_body=IGNORE_EOS)
    assert t.object == "text_completion" and t.choices[0].finish_reason == "length"
    assert t.choices[0].text
    assert t.usage is not None and t.usage.completion_tokens == 5 and t.usage.prompt_tokens > 0


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_streaming_with_usage(gw_priority: Server, route: str) -> None:
    c = client(gw_priority)
    common: dict[str, Any] = {
        "model": MODEL, "max_tokens": 7, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True}, "extra_body": IGNORE_EOS,
    }
    if route == "chat":
        chunks = list(c.chat.completions.create(
            messages=[{"role": "user", "content": "Write a haiku about the sea."}], **common))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    else:
        chunks = list(c.completions.create(prompt="Once upon a time", **common))
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text
    assert len({ch.id for ch in chunks}) == 1
    finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices]
    assert finish[-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 7 and last.usage.prompt_tokens > 0


def test_greedy_text_is_the_same_through_the_gateway(gw_priority: Server,
                                                      vllm_priority: Server) -> None:
    """The body reaches vLLM as sent (bar ``priority``): greedy output is identical."""
    req: dict[str, Any] = {"model": MODEL, "prompt": "Three primary colors are", "max_tokens": 8,
                           "temperature": 0}
    via = client(gw_priority).completions.create(**req).choices[0].text
    direct = client(vllm_priority).completions.create(**req).choices[0].text
    assert via == direct


def test_no_max_tokens_runs_to_vllms_own_end(gw_priority: Server,
                                             vllm_priority: Server) -> None:
    """A request without max_tokens reaches vLLM without one: vLLM's own default (chat: the
    rest of the context) holds, not a cap of the gateway's; greedy output identical to vLLM's."""
    req: dict[str, Any] = {
        "model": MODEL, "messages": [{"role": "user", "content": "the " * 1700}],
        "temperature": 0, "extra_body": {"ignore_eos": True}}
    via = client(gw_priority, timeout=300).chat.completions.create(**req)
    direct = client(vllm_priority, timeout=300).chat.completions.create(**req)
    assert via.usage is not None and direct.usage is not None
    # ignore_eos: vLLM ran to the end of its context, past any cap a gateway might invent
    assert direct.usage.prompt_tokens + direct.usage.completion_tokens == MAX_MODEL_LEN
    assert direct.usage.completion_tokens > 256
    assert via.usage.completion_tokens == direct.usage.completion_tokens
    assert via.choices[0].finish_reason == direct.choices[0].finish_reason == "length"
    assert via.choices[0].message.content == direct.choices[0].message.content


def test_models_are_vllms_own(gw_priority: Server, vllm_priority: Server) -> None:
    """/v1/models through the gateway is vLLM's list: max_model_len, root, parent kept."""
    _, _, direct = http("GET", vllm_priority.url + "/v1/models")
    _, _, via = http("GET", gw_priority.url + "/v1/models")
    want = json.loads(direct)["data"]
    got = [c for c in json.loads(via)["data"] if c["id"] == MODEL]  # not the ghost replica's
    assert [list(c) for c in got] == [list(c) for c in want]
    assert got[0]["max_model_len"] == MAX_MODEL_LEN and got[0]["owned_by"] == "vllm"
    assert (got[0]["id"], got[0]["root"], got[0]["parent"]) == (
        want[0]["id"], want[0]["root"], want[0]["parent"])


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_vllm_names_the_request_by_the_gateways_id(gw_priority: Server, vllm_priority: Server,
                                                    route: str) -> None:
    """The gateway sends its request id as ``X-Request-Id``: vLLM takes it as its own
    (``chatcmpl-<id>``, ``cmpl-<id>``), in the answer and in its log."""
    if route == "chat":
        path, doc = "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}
    else:
        path, doc = "/v1/completions", {"prompt": "hi"}
    body = json.dumps({"model": MODEL, "max_tokens": 2, **doc}).encode()
    code, headers, out = http("POST", gw_priority.url + path, body,
                              {"Content-Type": "application/json"}, timeout=120)
    assert code == 200, out
    rid = headers["x-qosgate-request-id"]
    vllm_id = ("chatcmpl-" if route == "chat" else "cmpl-") + rid
    assert json.loads(out)["id"] == vllm_id
    assert wait_until(lambda: f"Received request {vllm_id}" in vllm_priority.log.read_text(),
                      10), f"{vllm_id} not in vLLM's log"


# ------------------------------------------------------------------ priority in vLLM's queue
class Flood:
    """Streams through a gateway, each recording when its first token came and when it ended."""

    def __init__(self, gw: Server) -> None:
        self.c = client(gw, timeout=300)
        self.sent: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.done: dict[str, float] = {}
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []

    def start(self, name: str, max_tokens: int, **extra: Any) -> None:
        def run() -> None:
            try:
                stream = self.c.completions.create(
                    model=MODEL, prompt=f"Request {name}: tell a long story.",
                    max_tokens=max_tokens, temperature=0, stream=True, **extra,
                )
                for _ in stream:
                    self.first.setdefault(name, time.monotonic())
                self.done[name] = time.monotonic()
            except BaseException as exc:
                self.errors.append(exc)

        self.sent[name] = time.monotonic()
        th = threading.Thread(target=run, name=name, daemon=True)
        th.start()
        self.threads.append(th)

    def join(self) -> None:
        for th in self.threads:
            th.join(300)
        assert not self.errors, self.errors


def offline(as_priority: bool) -> dict[str, Any]:
    """An offline request: integer ``priority`` 3 (in vLLM's polarity, smaller first; the gateway
    maps it to its offline class and forwards the band, 3, as vLLM's priority), or the header."""
    if as_priority:
        return {"extra_body": {**IGNORE_EOS, "priority": 3}}
    return {"extra_body": IGNORE_EOS, "extra_headers": {"x-qos-class": "offline"}}


def queue_then_realtime(gw: Server, engine: Server) -> Flood:
    """Two offline requests running (one shorter, one long), four offline ones waiting inside
    vLLM (the gateway's window of 16 lets all six through), then one realtime request, sent while
    both of vLLM's slots are still busy."""
    wait_idle(engine)
    f = Flood(gw)
    f.start("run-short", 64, **offline(True))
    f.start("run-long", 160, **offline(True))
    assert wait_until(lambda: signals(engine).running == MAX_NUM_SEQS, 60)
    for i in range(4):
        f.start(f"wait-{i}", 12, **offline(i % 2 == 0))
        assert wait_until(lambda i=i: signals(engine).waiting == i + 1, 60)
    s = signals(engine)
    # a real scrape of a busy vLLM, read as load signals
    assert (s.running, s.waiting) == (MAX_NUM_SEQS, 4), s
    assert s.kv_usage is not None and 0.0 < s.kv_usage < 0.5, s  # a fraction, not a percentage
    assert s.preemptions_total == 0, s
    f.start("realtime", 4, extra_body=IGNORE_EOS, extra_headers={"x-qos-class": "realtime"})
    f.join()
    t0 = f.sent["run-short"]
    print("timeline (s): " + ", ".join(  # shown with -s, or when a test fails
        f"{n}: sent {f.sent[n] - t0:.2f} first {f.first[n] - t0:.2f} done {f.done[n] - t0:.2f}"
        for n in sorted(f.sent, key=lambda n: f.first[n])))
    assert f.sent["realtime"] < f.done["run-short"], "too slow: a slot freed before realtime came"
    assert all(f.first[f"wait-{i}"] > f.sent["realtime"] for i in range(4)), f.first
    return f


def test_priority_forwarded_in_vllm_polarity_jumps_vllms_queue(
    gw_priority: Server, vllm_priority: Server
) -> None:
    f = queue_then_realtime(gw_priority, vllm_priority)
    waited = [f.first[f"wait-{i}"] for i in range(4)]
    # realtime (sent on as priority 0) took the first slot that freed, before every offline
    # request (priority 3) queued ahead of it; vLLM does not preempt running requests, so it
    # did wait for that slot
    assert f.first["realtime"] < min(waited), f.first
    assert f.first["realtime"] > f.done["run-short"] - 1.0


def test_none_polarity_in_front_of_fcfs_vllm(gw_fcfs: Server, vllm_fcfs: Server) -> None:
    """``priority_polarity: none`` strips the priority; the fcfs vLLM serves in arrival order,
    so the same realtime request now waits behind every offline one queued before it."""
    f = queue_then_realtime(gw_fcfs, vllm_fcfs)
    waited = [f.first[f"wait-{i}"] for i in range(4)]
    assert f.first["realtime"] > max(waited), f.first


def flood_then_light(gw: Server, engine: Server) -> Flood:
    """Tenant ``flood``: two api requests running and four waiting inside vLLM (the window of
    16 lets all six through); then one api request of tenant ``light``, same class, sent while
    both of vLLM's slots are still busy."""
    wait_idle(engine)
    f = Flood(gw)
    f.c = client(gw, timeout=300).with_options(api_key="sk-flood")
    api = {"extra_body": IGNORE_EOS, "extra_headers": {"x-qos-class": "api"}}
    f.start("run-short", 64, **api)
    f.start("run-long", 160, **api)
    assert wait_until(lambda: signals(engine).running == MAX_NUM_SEQS, 60)
    for i in range(4):
        f.start(f"wait-{i}", 12, **api)
        assert wait_until(lambda i=i: signals(engine).waiting == i + 1, 60)
    f.c = f.c.with_options(api_key="sk-light")
    f.start("light", 4, **api)
    f.join()
    t0 = f.sent["run-short"]
    print("timeline (s): " + ", ".join(
        f"{n}: sent {f.sent[n] - t0:.2f} first {f.first[n] - t0:.2f} done {f.done[n] - t0:.2f}"
        for n in sorted(f.sent, key=lambda n: f.first[n])))
    assert f.sent["light"] < f.done["run-short"], "too slow: a slot freed before light came"
    return f


def test_the_forwarded_order_puts_a_light_tenant_ahead_in_vllms_queue(
    gw_tenants: Server, vllm_priority: Server
) -> None:
    """qosgate's whole order reaches vLLM's queue: the light tenant, sent after the flood's four
    waiting requests of the same class, is ordered before them (its fair-share rank), and vLLM
    starts it in the first slot that frees; the flood's own four keep their order."""
    f = flood_then_light(gw_tenants, vllm_priority)
    waited = [f.first[f"wait-{i}"] for i in range(4)]
    assert f.first["light"] < min(waited), f.first
    assert waited == sorted(waited), f.first


def test_the_class_alone_leaves_a_light_tenant_behind_in_vllms_queue(
    gw_tenants_class: Server, vllm_priority: Server
) -> None:
    """With ``priority_order: class`` every api request is sent as priority 1, and vLLM breaks
    the tie by arrival: the light tenant waits behind all four (what the full order fixes)."""
    f = flood_then_light(gw_tenants_class, vllm_priority)
    waited = [f.first[f"wait-{i}"] for i in range(4)]
    assert f.first["light"] > max(waited), f.first


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize("stream", [False, True])
def test_vllms_400_reaches_the_client_in_openai_format(gw_priority: Server, stream: bool) -> None:
    c = client(gw_priority)
    asked = MAX_MODEL_LEN + 952
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=asked,
            stream=stream,
        )
    assert e.value.status_code == 400
    assert e.value.response.json() == {
        "error": {
            "message": f"max_tokens={asked} cannot be greater than max_model_len="
            f"{MAX_MODEL_LEN}. Please request fewer output tokens. "
            f"(parameter=max_tokens, value={asked})",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }
    }


def test_vllms_404_reaches_the_client_in_openai_format(gw_priority: Server) -> None:
    """A model the gateway is configured to route but vLLM does not serve: vLLM's own 404."""
    with pytest.raises(openai.NotFoundError) as e:
        client(gw_priority).completions.create(model=GHOST, prompt="x", max_tokens=2)
    assert e.value.response.json() == {
        "error": {
            "message": f"The model `{GHOST}` does not exist. Valid aliases: {MODEL}.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


def test_gateways_own_404_is_in_openai_format(gw_priority: Server) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client(gw_priority).completions.create(model="nope", prompt="x", max_tokens=2)
    err = e.value.response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert "nope" in err["message"]


# ------------------------------------------------------------------ disconnect
def test_client_disconnect_aborts_the_request_inside_vllm(
    gw_priority: Server, vllm_priority: Server
) -> None:
    wait_idle(vllm_priority)

    def generated() -> float:
        _, _, raw = http("GET", vllm_priority.url + "/metrics")
        return sum(metric_values(raw.decode(), "vllm:generation_tokens_total").values())

    def cancelled() -> float:
        _, _, raw = http("GET", gw_priority.url + "/metrics")
        values = metric_values(raw.decode(), "qosgate_requests_total")
        return sum(v for k, v in values.items() if ("outcome", "cancelled") in k)

    tokens0, cancelled0 = generated(), cancelled()
    stream = client(gw_priority, timeout=60).completions.create(
        model=MODEL, prompt="Count to a thousand:", max_tokens=1500, stream=True,
        extra_body=IGNORE_EOS,
    )
    rid = next(iter(stream)).id  # vLLM's id: it is generating
    assert wait_until(lambda: signals(vllm_priority).running == 1, 30)
    stream.close()  # the client goes away

    # vLLM logs the abort (--enable-log-requests) and stops generating at once
    assert wait_until(
        lambda: any(rid in line and "aborted" in line.lower()
                    for line in vllm_priority.log.read_text().splitlines()), 30
    ), f"vLLM did not log an abort of {rid}"
    assert wait_until(lambda: signals(vllm_priority).running == 0, 30)
    assert generated() - tokens0 < 1500 / 4  # far from the 1500 it was asked for
    assert wait_until(lambda: cancelled() == cancelled0 + 1, 10)  # the gateway's outcome
    # NB: vLLM 0.32 does not count a client abort in
    # vllm:request_success_total{finished_reason="abort"} (test_contract.py pins that)


# ------------------------------------------------------------------ metrics as load signals
def test_idle_vllm_metrics_read_as_load_signals(vllm_priority: Server) -> None:
    wait_idle(vllm_priority)
    s = signals(vllm_priority)
    assert (s.running, s.waiting, s.preemptions_total) == (0, 0, 0)
    assert s.kv_usage is not None and 0.0 <= s.kv_usage < 0.01


# ------------------------------------------------------------------ whole answers
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 8, "seed": 7, "logprobs": True, "top_logprobs": 2}
COMPLETION = {"model": MODEL, "prompt": "Three primary colors are", "max_tokens": 6, "seed": 7,
              "logprobs": 2}
# vLLM refuses n > 1 with greedy sampling: n=2 is sampled, with a seed
WHOLE = {
    "chat-greedy": ("/v1/chat/completions", {**CHAT, "temperature": 0}),
    "chat-n2": ("/v1/chat/completions", {**CHAT, "temperature": 0.7, "n": 2}),
    "completions-greedy": ("/v1/completions", {**COMPLETION, "temperature": 0}),
    "completions-n2": ("/v1/completions", {**COMPLETION, "temperature": 0.7, "n": 2}),
}


@pytest.mark.parametrize("case", list(WHOLE))
def test_a_whole_answer_through_the_gateway_is_vllms_own(
    gw_fcfs: Server, vllm_fcfs: Server, case: str
) -> None:
    """The gateway forwards a whole request as sent: the same JSON as vLLM's own whole answer,
    member for member and in its order, apart from ``id`` and ``created`` (and the last digits
    of log-probabilities, which vLLM's arithmetic does not reproduce bit for bit from one batch
    to the next)."""
    path, body = WHOLE[case]
    raw = json.dumps(body).encode()
    code, _, direct = http("POST", vllm_fcfs.url + path, raw,
                           {"Content-Type": "application/json"}, timeout=120)
    assert code == 200, direct
    code, gw_headers, via = http("POST", gw_fcfs.url + path, raw,
                                 {"Content-Type": "application/json"}, timeout=120)
    assert code == 200, via
    assert gw_headers["content-type"] == "application/json"
    want, got = json.loads(direct), json.loads(via)
    assert len(want["choices"]) == body.get("n", 1) and want["choices"][0]["logprobs"]
    same_json({**got, "id": want["id"], "created": want["created"]}, want)
