"""A batch store on its own, as the store tests drive it: a job's lines, a store opened in a
directory for one call, a job created and validated, answers, a JSONL file read back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from qosgate.runtime.batches.records import BatchRecord, LineResult
from qosgate.runtime.batches.store import BatchStore

T = TypeVar("T")
MODEL = "m"
CHAT = "/v1/chat/completions"


class Clock:
    def __init__(self) -> None:
        self.t = 1_700_000_000.0

    def __call__(self) -> float:
        return self.t


def line(cid: str, content: str = "hi", model: str = MODEL, url: str = CHAT,
         method: str = "POST") -> str:
    return json.dumps({"custom_id": cid, "method": method, "url": url,
                       "body": {"model": model, "messages": [{"role": "user",
                                                              "content": content}]}})


def run(fn: Callable[[BatchStore], Awaitable[T]], directory: Path, clock: Clock | None = None,
        max_lines: int | None = None) -> T:
    """``fn`` on a store opened in ``directory`` (and closed after)."""
    async def go() -> T:
        store = BatchStore(directory, clock or Clock(), max_lines)
        await store.open()
        try:
            return await fn(store)
        finally:
            await store.close()
    return asyncio.run(go())


async def upload(store: BatchStore, text: str, tenant: str = "t") -> str:
    staged = store.staging_path()
    staged.write_text(text)
    rec = await store.add_file(tenant, "batch", "in.jsonl", staged, len(text.encode()),
                               text.count("\n"))
    return rec.id


async def job(store: BatchStore, lines: list[str], tenant: str = "t",
              serves: Callable[[str], bool] = lambda m: m == MODEL) -> BatchRecord:
    """A job of ``lines``, created, claimed with fence 1 and validated."""
    fid = await upload(store, "".join(x + "\n" for x in lines), tenant)
    b = await store.create_batch(tenant, fid, CHAT, "24h", 86_400, "batch", {"k": "v"})
    assert b.status == "validating"
    assert await store.claim(b.id, 1)
    return await store.validate(b.id, serves, 1)


def ok(batch_id: str, n: int, text: str = "x") -> LineResult:
    body = json.dumps({"choices": [{"message": {"content": text}}]}).encode()
    return LineResult(batch_id, n, f"req-{n}", 200, body)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]
