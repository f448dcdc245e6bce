"""The vLLM stand-in driven through its ASGI callable, in this process: no socket, no server.

Each call runs on an event loop of its own (``asyncio.run``): the stand-in's engine is started,
the requests are served one after the other, and the engine is closed. The client never goes
away before the answer ends (the stand-in's disconnect watch waits for the answer's last body).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from qosgate.standin.server import StandIn

MODEL = "smollm2-135m-instruct"
TIME_SCALE = 0.001  # the modelled engine's time, sped up: answers in milliseconds


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes

    def events(self) -> list[bytes]:
        """An SSE stream's ``data:`` lines, as sent (``data: [DONE]`` included)."""
        return [line for line in self.body.split(b"\n") if line.startswith(b"data: ")]

    def chunks(self) -> list[dict[str, Any]]:
        """An SSE stream's JSON chunks, in order."""
        return [json.loads(e[6:]) for e in self.events() if e != b"data: [DONE]"]

    def json(self) -> Any:
        return json.loads(self.body)


async def _post(app: StandIn, path: str, body: bytes) -> Answer:
    ended = asyncio.Event()
    asked = False
    status = 0
    parts: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": body, "more_body": False}
        await ended.wait()
        return {"type": "http.disconnect"}

    async def send(msg: MutableMapping[str, Any]) -> None:
        nonlocal status
        if msg["type"] == "http.response.start":
            status = msg["status"]
        elif msg["type"] == "http.response.body":
            parts.append(msg.get("body", b""))
            if not msg.get("more_body", False):
                ended.set()

    scope = {"type": "http", "method": "POST", "path": path, "headers": [],
             "query_string": b""}
    await app(scope, receive, send)
    return Answer(status, b"".join(parts))


def post_all(requests: list[tuple[str, dict[str, Any]]], **standin: Any) -> list[Answer]:
    """Each ``(path, body)`` answered, in order, by one stand-in made with ``standin``."""

    async def serve() -> list[Answer]:
        app = StandIn(served_model_name=MODEL, time_scale=TIME_SCALE, **standin)
        await app.engine.start()
        try:
            return [await _post(app, path, json.dumps(body).encode())
                    for path, body in requests]
        finally:
            await app.engine.close()

    return asyncio.run(serve())


def post(path: str, body: dict[str, Any], **standin: Any) -> Answer:
    """``body`` answered by a stand-in of its own."""
    return post_all([(path, body)], **standin)[0]


def post_together(requests: list[tuple[str, dict[str, Any]]], **standin: Any) -> list[Answer]:
    """Each ``(path, body)`` sent at once to one stand-in made with ``standin``, and answered."""

    async def serve() -> list[Answer]:
        app = StandIn(served_model_name=MODEL, time_scale=TIME_SCALE, **standin)
        await app.engine.start()
        try:
            return list(await asyncio.gather(
                *(_post(app, path, json.dumps(body).encode()) for path, body in requests)))
        finally:
            await app.engine.close()

    return asyncio.run(serve())
