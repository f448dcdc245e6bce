"""A reload of the config file under load, as an operator does it: ``qosgate serve --config``
in front of the stand-in, openai-client streams running, the file rewritten (a tenant and its
key added, a limit lowered) and SIGHUP sent. New requests get the new rules at once, the ones
in flight finish under the rules they were admitted with, and every request sent ends in one
outcome, as the client saw it and as the gateway counted it. Then a file that cannot be applied
is refused with its reason in the log and the running config kept; ``POST /v1/qos/reload``
does the same as SIGHUP; and ``--workers 2`` reloads in every worker."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml

from tests.support.fleet import metric, recorded_raw, scrape
from tests.support.httpclient import http
from tests.support.processes import MODEL, Server, start_gateway, start_standin
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e

ADMIN = "sk-admin"


def config(standin: Server, acme_rpm: float, new_tenant: bool) -> dict[str, Any]:
    tenants: list[dict[str, Any]] = [
        {"name": "acme", "api_keys": ["sk-acme"], "limits": {"requests_per_minute": acme_rpm}}]
    if new_tenant:
        tenants.append({"name": "newco", "api_keys": ["sk-new"]})
    return {"server": {"admin_keys": [ADMIN]}, "tenants": tenants,
            "upstreams": [{"url": standin.url, "name": "s0"}]}


def status(gw: Server) -> dict[str, Any]:
    _, _, body = http("GET", gw.url + "/v1/qos/status", None,
                      {"authorization": f"Bearer {ADMIN}"})
    doc: dict[str, Any] = json.loads(body)
    return doc


def generation(gw: Server) -> int:
    return int(status(gw)["config"]["generation"])


def ask(gw: Server, key: str, stream: bool = True) -> None:
    c = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=60)
    msgs: Any = [{"role": "user", "content": "hi"}]
    if stream:
        for _ in c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16,
                                           stream=True):
            pass
    else:
        c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4)


class Load:
    """Streams from ``key`` on a few threads until stopped; each request's outcome as the
    client saw it (``completed`` or the HTTP status of its refusal)."""

    def __init__(self, gw: Server, key: str, threads: int = 4) -> None:
        self.gw, self.key = gw, key
        self.seen: Counter[str] = Counter()
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self.run) for _ in range(threads)]

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                ask(self.gw, self.key)
                what = "completed"
            except openai.APIStatusError as exc:
                what = str(exc.status_code)
                assert exc.status_code != 429 or exc.response.headers.get("retry-after")
            except BaseException as exc:  # reported by the test
                self.errors.append(exc)
                return
            with self.lock:
                self.seen[what] += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_a_key_added_and_a_limit_lowered_by_sighup_under_load(tmp_path: Path) -> None:
    standin = start_standin(tmp_path, "--time-scale", "0.2")
    path = tmp_path / "qosgate.yaml"
    path.write_text(yaml.safe_dump(config(standin, 6000, new_tenant=False)))
    gw = start_gateway(tmp_path, "--config", str(path))
    try:
        with pytest.raises(openai.AuthenticationError):
            ask(gw, "sk-new")
        with Load(gw, "sk-acme") as load:
            assert wait_until(lambda: load.seen["completed"] >= 8, 60)
            path.write_text(yaml.safe_dump(config(standin, 1, new_tenant=True)))
            before = dict(load.seen)
            t0 = time.monotonic()
            gw.proc.send_signal(signal.SIGHUP)
            assert wait_until(lambda: generation(gw) == 2, 10)
            took = time.monotonic() - t0
            ask(gw, "sk-new")  # the new key serves at once
            # acme's limit is 1 a minute now: its streams are refused with Retry-After
            assert wait_until(lambda: load.seen["429"] >= 4, 60)
        assert not load.errors, load.errors
        assert set(load.seen) == {"completed", "429"}, load.seen
        print(f"reload under load: generation 2 seen {took * 1000:.0f} ms after SIGHUP; "
              f"acme before it {before}, in all {dict(load.seen)}")
        text = scrape(gw)
        # every request acme sent ended in one outcome, as the client saw it and as counted
        assert metric(text, "qosgate_requests_total", {"tenant": "acme", "outcome": "completed"}
                      ) == load.seen["completed"]
        assert metric(text, "qosgate_requests_total", {"tenant": "acme", "outcome": "rejected"}
                      ) == load.seen["429"]
        assert metric(text, "qosgate_config_reloads_total", {"outcome": "applied"}) == 1
        assert "config reloaded (generation 2): tenants +1 -0 ~1; keys +1 -0" in gw.log.read_text()

        # a file that cannot be applied: refused, its reason logged, the running config kept
        path.write_text("tenants: [{name: acme, api_keys: [sk-acme], limits: {rpm: 5}}]\n")
        gw.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "config reload refused" in gw.log.read_text(), 10)
        assert "rpm" in gw.log.read_text().split("config reload refused")[1]
        assert generation(gw) == 2
        ask(gw, "sk-new")
        assert metric(scrape(gw), "qosgate_config_reloads_total", {"outcome": "refused"}) == 1

        # the admin endpoint does what SIGHUP does, and answers what changed or why not
        code, _, body = http("POST", gw.url + "/v1/qos/reload", b"",
                             {"authorization": f"Bearer {ADMIN}"})
        assert code == 400 and json.loads(body)["error"]["code"] == "config_refused"
        path.write_text(yaml.safe_dump(config(standin, 6000, new_tenant=False)))
        code, _, body = http("POST", gw.url + "/v1/qos/reload", b"",
                             {"authorization": "Bearer sk-acme"})
        assert code == 401
        code, _, body = http("POST", gw.url + "/v1/qos/reload", b"",
                             {"authorization": f"Bearer {ADMIN}"})
        doc = json.loads(body)
        assert code == 200 and doc["generation"] == 3, doc
        assert doc["tenants"] == {"added": [], "removed": ["newco"], "changed": ["acme"]}
        with pytest.raises(openai.AuthenticationError):
            ask(gw, "sk-new")
        ask(gw, "sk-acme", stream=False)
    finally:
        gw.stop()
        standin.stop()


def test_every_worker_reloads_on_sighup(tmp_path: Path) -> None:
    standin = start_standin(tmp_path, "--time-scale", "0.2")
    path = tmp_path / "qosgate.yaml"
    path.write_text(yaml.safe_dump(config(standin, 6000, new_tenant=False)))
    gw = start_gateway(tmp_path, "--config", str(path), "--workers", "2")
    try:
        instances = set()

        def both_at(gen: int) -> bool:
            _, _, body = http("GET", gw.url + "/v1/qos/status", None,
                              {"authorization": f"Bearer {ADMIN}"})
            doc = json.loads(body)
            if doc["config"]["generation"] != gen:
                instances.clear()
                return False
            instances.add(doc["instance"])
            return len(instances) == 2

        assert wait_until(lambda: both_at(1), 30)  # both workers answer
        path.write_text(yaml.safe_dump(config(standin, 6000, new_tenant=True)))
        gw.proc.send_signal(signal.SIGHUP)
        instances.clear()
        assert wait_until(lambda: both_at(2), 30)
        for _ in range(10):  # whichever worker takes it
            ask(gw, "sk-new", stream=False)
    finally:
        gw.stop()
        standin.stop()


def test_an_upstream_added_and_one_retired_by_a_reload(tmp_path: Path) -> None:
    """The file names a second stand-in and drops the first: the new one is probed and takes
    the requests that follow, the retired one takes none (the stream it runs finishes there)."""
    old = start_standin(tmp_path, "--time-scale", "0.2")
    new = start_standin(tmp_path, "--time-scale", "0.2")
    path = tmp_path / "qosgate.yaml"
    doc = config(old, 6000, new_tenant=False)
    path.write_text(yaml.safe_dump(doc))
    gw = start_gateway(tmp_path, "--config", str(path))
    try:
        c = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-acme", max_retries=0,
                          timeout=60)
        running = c.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                            "content": "long"}], max_tokens=200, stream=True)
        first = next(iter(running))  # a stream begun on the old one
        assert first.id
        doc["upstreams"] = [{"url": new.url, "name": "s1"}]
        path.write_text(yaml.safe_dump(doc))
        gw.proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: generation(gw) == 2, 10)
        assert "upstreams +1 -1" in gw.log.read_text()

        def swapped() -> bool:
            reps = status(gw)["replicas"]
            return bool(reps["s1"]["eligible"] and reps["s0"]["retired"])

        assert wait_until(swapped, 10)  # the new one probed up first, then the old retired
        assert sum(1 for _ in running) > 0  # the retired replica's stream went on to its end
        before = len(recorded_raw(old))
        for _ in range(5):
            ask(gw, "sk-acme", stream=False)
        assert len(recorded_raw(new)) == 5 and len(recorded_raw(old)) == before
    finally:
        gw.stop()
        new.stop()
        old.stop()
