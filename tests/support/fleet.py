"""A fleet of stand-ins behind a real gateway: its config (four classes, a fixed window, the
most-free router), the official client's requests, and the fault switches and records of each
stand-in (``standin/faults.py``)."""

from __future__ import annotations

import base64
import contextlib
import json
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from openai import OpenAI

from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import MODEL, Server

Labels = dict[str, str]


def classes(first_byte_timeout_s: float | None = None) -> list[dict[str, Any]]:
    """The four classes, without deadline admission (these tests are about faults, not
    shedding), with a first-byte bound if one is given."""
    out: list[dict[str, Any]] = [
        {"name": "realtime", "level": 0, "strict": True, "ttft_budget_ms": 1000,
         "queue_timeout_s": 60, "max_queue": 2000, "can_preempt": True},
        {"name": "api", "level": 1, "weight": 5, "ttft_budget_ms": 5000, "queue_timeout_s": 60,
         "max_queue": 2000},
        {"name": "batch", "level": 2, "weight": 3, "ttft_budget_ms": 30000,
         "queue_timeout_s": 120, "max_queue": 2000, "preemptible": True},
        {"name": "offline", "level": 3, "weight": 2, "ttft_budget_ms": 300000,
         "queue_timeout_s": 120, "max_queue": 2000, "preemptible": True},
    ]
    if first_byte_timeout_s is not None:
        for c in out:
            c["first_byte_timeout_s"] = first_byte_timeout_s
    return out


def fleet(**over: Any) -> dict[str, Any]:
    """A ``fleet:`` section: the most-free router (ties go to the first listed replica, which
    these tests rely on), a fixed window and no prefill budget."""
    out: dict[str, Any] = {"router": "most-free", **over}
    out.setdefault("window", {"mode": "fixed"})
    out.setdefault("prefill_budget_tokens", None)
    return out


def write_config(path: Path, upstreams: list[dict[str, Any]], *,
                 first_byte_timeout_s: float | None = None,
                 fleet_over: dict[str, Any] | None = None,
                 tenants: list[dict[str, Any]] | None = None) -> Path:
    cfg: dict[str, Any] = {
        "classes": classes(first_byte_timeout_s),
        "server": {"admin_keys": ["sk-admin"]},
        "upstreams": upstreams,
    }
    cfg["fleet"] = fleet(**(fleet_over or {}))
    if tenants is not None:
        cfg["tenants"] = tenants
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    return path


def upstream(s: Server, name: str, capacity: int = 64) -> dict[str, Any]:
    return {"url": s.url, "name": name, "max_window": capacity, "priority_polarity": "vllm"}


@contextlib.contextmanager
def running(*servers: Server) -> Iterator[None]:
    try:
        yield
    finally:
        for s in reversed(servers):
            s.stop()


def client(gw: Server, key: str = "sk-admin", timeout: float = 60.0) -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def scrape(gw: Server) -> str:
    code, _, body = http("GET", gw.url + "/metrics")
    assert code == 200
    return body.decode()


def metric(text: str, name: str, labels: Labels | None = None) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    want = set((labels or {}).items())
    return sum(v for k, v in metric_values(text, name).items() if want <= set(k))


def outcomes(text: str) -> Counter[tuple[str, str]]:
    """qosgate_requests_total as {(outcome, reason): count}."""
    out: Counter[tuple[str, str]] = Counter()
    for k, v in metric_values(text, "qosgate_requests_total").items():
        d = dict(k)
        out[(d["outcome"], d["reason"])] += int(v)
    return out


def faults(s: Server) -> dict[str, Any]:
    return dict(json.loads(http("GET", s.url + "/admin/fault")[2]))


def switch(s: Server, doc: dict[str, Any]) -> None:
    code, _, body = http("POST", s.url + "/admin/fault", json.dumps(doc).encode())
    assert code == 200, body


def recorded_raw(s: Server) -> list[bytes]:
    """The bodies a stand-in received, byte for byte, oldest first."""
    _, _, body = http("GET", s.url + "/debug/requests")
    return [base64.b64decode(r["body"]) for r in json.loads(body)["requests"]]


def recorded_bodies(s: Server) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in recorded_raw(s)]


def markers(path: Path) -> set[str]:
    """The request markers (first message's content) in a stand-in's ``--record`` file."""
    if not path.exists():
        return set()
    out = set()
    for line in path.read_text().splitlines():
        body = json.loads(base64.b64decode(json.loads(line)["body"]))
        if "messages" in body:  # (not a continuation: token ids, no marker)
            out.add(body["messages"][0]["content"])
    return out


def ask(c: OpenAI, model: str = MODEL, *, stream: bool = False, max_tokens: int = 3,
        content: str = "hi", **kw: Any) -> str:
    """One chat request to its end; its text (raises the client's error)."""
    msgs: Any = [{"role": "user", "content": content}]
    if not stream:
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens, **kw)
        assert r.choices[0].finish_reason in ("stop", "length")
        return r.choices[0].message.content or ""
    parts, finish = [], None
    for ch in c.chat.completions.create(model=model, messages=msgs, max_tokens=max_tokens,
                                         stream=True, **kw):
        if ch.choices:
            parts.append(ch.choices[0].delta.content or "")
            finish = ch.choices[0].finish_reason or finish
    assert finish in ("stop", "length")
    return "".join(parts)
