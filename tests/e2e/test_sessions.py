"""Sessions through real processes: the ``x-session-id`` header (sent by the official ``openai``
client) keeps a conversation's turns on one replica under ``session-affinity`` even where
least-load would move them, the turn after that replica dies lands elsewhere and stays there;
OpenAI's ``user`` does the same where opted in; a bad session header is a 400; the engines'
reported cached tokens reach the gateway's metrics."""

from __future__ import annotations

import base64
import functools
import http.client as httpc
import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import MODEL, start_gateway, start_standin
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

REPLICAS = 3


def fleet_config(urls: list[str], router: str, from_user: bool = False) -> str:
    ups = "\n".join(f"  - {{url: {u}, name: r{i}, max_window: 8, priority_polarity: vllm}}"
                    for i, u in enumerate(urls))
    return (f"upstreams:\n{ups}\nfleet:\n  router: {router}\n"
            f"  cache: {{session_from_user: {str(from_user).lower()}}}\n")


class Fleet:
    """Stand-ins r0..r2 behind one gateway."""

    def __init__(self, tmp: Path, router: str, from_user: bool = False) -> None:
        self.standins = [start_standin(tmp, "--time-scale", "0.2",
                                       "--enable-prompt-tokens-details")
                         for _ in range(REPLICAS)]
        path = tmp / f"gw-{router}-{from_user}-{self.standins[0].port}.yaml"
        path.write_text(fleet_config([s.url for s in self.standins], router, from_user))
        self.gw = start_gateway(tmp, "--config", str(path))
        self.client = OpenAI(base_url=self.gw.url + "/v1", api_key="x", max_retries=0)
        self.background: list[httpc.HTTPConnection] = []

    def stop(self) -> None:
        self.release()
        self.gw.stop_timeout = 3.0
        self.gw.stop()
        for s in self.standins:
            s.stop()

    def where(self, marker: str) -> list[int]:
        """The stand-ins whose last user message of some request was ``marker``."""
        out = []
        for k, s in enumerate(self.standins):
            if s.proc.poll() is not None:
                continue
            recorded = json.loads(http("GET", s.url + "/debug/requests")[2])["requests"]
            for rec in recorded:
                msgs = json.loads(base64.b64decode(rec["body"])).get("messages") or []
                if msgs and msgs[-1]["content"] == marker:
                    out.append(k)
        return out

    def inflight(self) -> list[int]:
        view = json.loads(http("GET", self.gw.url + "/v1/qos/status")[2])
        return [int(view["replicas"][f"r{k}"]["inflight"]) for k in range(REPLICAS)]

    def busier(self, replica: int) -> None:
        """Open long streams with no session (least-load places them) until ``replica`` has
        more in flight than the least loaded one: least-load would send a new turn elsewhere."""
        for _ in range(12):
            loads = self.inflight()
            if loads[replica] > min(loads):
                return
            conn = httpc.HTTPConnection("127.0.0.1", self.gw.port, timeout=30)
            body = json.dumps({"model": MODEL, "stream": True, "max_tokens": 20000,
                               "messages": [{"role": "user", "content": "background"}]})
            conn.request("POST", "/v1/chat/completions", body,
                         {"content-type": "application/json"})
            resp = conn.getresponse()
            assert resp.status == 200
            resp.fp.readline()  # its first event: it runs at a replica now
            self.background.append(conn)
            assert wait_until(functools.partial(self.placed, len(self.background)))
        raise AssertionError(f"could not load r{replica} above the least loaded: {loads}")

    def placed(self, n: int) -> bool:
        """At least ``n`` requests in flight at the replicas."""
        return sum(self.inflight()) >= n

    def release(self) -> None:
        for conn in self.background:
            conn.close()
        self.background.clear()


def turn(f: Fleet, messages: list[dict[str, str]], text: str, session: str | None = None,
         user: str | None = None) -> int:
    """One turn: ``text`` appended as the user's message, the answer as the assistant's; the
    replica it ran on."""
    messages.append({"role": "user", "content": text})
    extra = {"user": user} if user is not None else {}
    r = f.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4,  # type: ignore[arg-type]
        extra_headers={"x-session-id": session} if session else None, **extra)
    messages.append({"role": "assistant", "content": r.choices[0].message.content or ""})
    where = f.where(text)
    assert len(where) == 1, where
    return where[0]


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path, "session-affinity")
    yield f
    f.stop()


def test_a_session_sticks_to_its_replica_and_moves_when_it_dies(fleet: Fleet) -> None:
    system = {"role": "system", "content": "You answer in one word. " * 40}
    msgs = [dict(system)]
    home = turn(fleet, msgs, "conv-a turn 1", session="conv-a")
    fleet.busier(home)  # least-load would now place a new request elsewhere
    assert turn(fleet, msgs, "conv-a turn 2", session="conv-a") == home
    # a request without a session goes by load: not to the busier replica
    other = [dict(system)]
    assert turn(fleet, other, "no session turn 1") != home
    fleet.release()
    assert wait_until(lambda: sum(fleet.inflight()) == 0, 10)
    # the session's replica dies: its next turn is retried elsewhere, and the session stays there
    assert http("POST", fleet.standins[home].url + "/admin/fault", b'{"fault": "die"}')[0] == 200
    assert wait_until(lambda: fleet.standins[home].proc.poll() is not None, 10)
    moved = turn(fleet, msgs, "conv-a turn 3", session="conv-a")
    assert moved != home
    fleet.busier(moved)
    assert turn(fleet, msgs, "conv-a turn 4", session="conv-a") == moved


def test_session_from_user_where_opted_in(tmp_path: Path) -> None:
    f = Fleet(tmp_path, "session-affinity", from_user=True)
    try:
        msgs = [{"role": "system", "content": "Be brief. " * 60}]
        home = turn(f, msgs, "user-u turn 1", user="u-17")
        f.busier(home)
        assert turn(f, msgs, "user-u turn 2", user="u-17") == home
        # the header wins over the user field: another session, placed by load
        assert turn(f, msgs, "user-u turn 3", session="other", user="u-17") != home
    finally:
        f.stop()


def test_bad_session_header_and_cached_tokens_in_metrics(fleet: Fleet) -> None:
    c = fleet.client
    with pytest.raises(openai.BadRequestError) as exc:
        c.chat.completions.create(model=MODEL, max_tokens=2,
                                  messages=[{"role": "user", "content": "hi"}],
                                  extra_headers={"x-session-id": "x" * 300})
    err = exc.value.body
    assert isinstance(err, dict)
    assert (err["code"], err["param"]) == ("invalid_session", "x-session-id")
    assert "printable ASCII" in err["message"]
    # what the client library will not send, a raw request does
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    for bad in ("caf\u00e9", "   "):
        code, _, out = http("POST", fleet.gw.url + "/v1/chat/completions", body.encode(),
                            {"content-type": "application/json", "x-session-id": bad})
        assert code == 400 and json.loads(out)["error"]["code"] == "invalid_session"
    # the engines' cached prompt tokens, as the client saw them, are the gateway's counts
    msgs: list[dict[str, str]] = [{"role": "system", "content": "Cache me. " * 200}]
    seen_prompt = seen_cached = 0
    for k in range(3):
        msgs.append({"role": "user", "content": f"turn {k} " * 30})
        chunks = list(c.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=3, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True}, extra_headers={"x-session-id": "m"}))
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        seen_prompt += usage.prompt_tokens
        seen_cached += usage.prompt_tokens_details.cached_tokens or 0
        msgs.append({"role": "assistant", "content": "".join(
            ch.choices[0].delta.content or "" for ch in chunks if ch.choices)})
    assert seen_cached > 0  # turns 2 and 3 found the conversation so far cached
    text = http("GET", fleet.gw.url + "/metrics")[2].decode()
    counts = metric_values(text, "qosgate_replica_prompt_tokens_total")
    by_kind = {kind: sum(v for lb, v in counts.items() if ("kind", kind) in lb)
               for kind in ("offered", "cached")}
    assert by_kind == {"offered": seen_prompt, "cached": seen_cached}
