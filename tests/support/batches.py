"""Batch jobs end to end: a gateway config with a batch directory, the official client's calls, and
what the stand-in recorded (each line a marker ``line N`` in its prompt)."""

from __future__ import annotations

import base64
import json
import re
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

from openai import OpenAI

from tests.support.processes import MODEL, Server
from tests.support.waiting import wait_until

CHAT = "/v1/chat/completions"


_LINE = re.compile(rb"line (\d+)\b")


def config(tmp: Path, standin: Server, extra: str = "", capacity: int = 8,
           own_dir: bool = True) -> Path:
    """A gateway's config; ``own_dir``: ``batches.dir`` is ``tmp/batches`` (else the default,
    per listening address)."""
    path = tmp / f"gw-{time.monotonic_ns()}.yaml"
    dir_line = f"dir: {tmp / 'batches'}" if own_dir else ""
    path.write_text(f"""
tenants:
  - {{name: acme, api_keys: [sk-acme]}}
  - {{name: pair, api_keys: [sk-pair], limits: {{max_concurrent: 2}}}}
upstreams:
  - url: {standin.url}
    max_window: {capacity}
batches:
  {dir_line}
  live_span_s: 0.2  # no live traffic here: the whole fleet is the job's 0.2 s after start
  windows: ["24h", "3s"]
  backoff_s: 0.05
  backoff_max_s: 0.2
  retries: 2
{extra}""")
    return path


def bodies(tmp: Path, name: str = "bodies.jsonl") -> Counter[int]:
    """How many times the engine received each line (by the ``line N`` its prompt names), from
    the stand-in's ``--record`` file ``tmp/name``."""
    seen: Counter[int] = Counter()
    path = tmp / name
    if path.exists():
        for raw in path.read_bytes().splitlines():
            m = _LINE.search(base64.b64decode(json.loads(raw)["body"]))
            if m is not None:
                seen[int(m.group(1))] += 1
    return seen


def client(gw: Server, key: str = "sk-acme") -> OpenAI:
    return OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


def submit(c: OpenAI, tmp: Path, n: int, window: str = "24h", max_tokens: int = 8,
           model: str = MODEL) -> str:
    path = tmp / f"in-{n}.jsonl"
    path.write_text("".join(json.dumps({
        "custom_id": f"req-{i}", "method": "POST", "url": CHAT,
        "body": {"model": model, "max_tokens": max_tokens,
                 "messages": [{"role": "user", "content": f"line {i} of the job"}]},
    }) + "\n" for i in range(n)))
    with path.open("rb") as f:
        fid = c.files.create(file=f, purpose="batch").id
    return c.batches.create(input_file_id=fid, endpoint=CHAT,
                            completion_window=window).id  # type: ignore[arg-type]


def wait_status(c: OpenAI, batch_id: str, statuses: set[str], timeout: float = 60) -> Any:
    got: list[Any] = []

    def ended() -> bool:
        got[:] = [c.batches.retrieve(batch_id)]
        return got[0].status in statuses

    assert wait_until(ended, timeout=timeout, every=0.1), got
    return got[0]


def lines_of(c: OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(x) for x in c.files.content(file_id).content.splitlines()]


def completed_so_far(c: OpenAI, batch_id: str) -> int:
    rc = c.batches.retrieve(batch_id).request_counts
    return 0 if rc is None else rc.completed


def answered_lines(directory: Path) -> set[int]:
    """The lines with an answer recorded in the job's database (read beside the gateway)."""
    with sqlite3.connect(directory / "batches.sqlite3") as db:
        return {r[0] for r in db.execute("SELECT line FROM lines WHERE answered = 1")}
