"""A batch job's line run as one more request through the gateway's own ``RequestFlow``.

An in-memory ASGI call: the scope carries a configured key of the job's tenant (none in open
mode; keys are never stored with the job), ``x-qos-class`` of the job's class and the
``BATCH_LINE`` mark (the line runs at that class, without the tier's boost); ``receive`` gives
the line's body, then waits until the feeder stops the line (``http.disconnect``: the flow
removes it from the queue or aborts it at its engine); ``send`` collects the response. So a line
is classified (unboosted), clamped to the tenant's classes, rate-limited, fair-shared, metered
and counted as any other request is: one way in, no second admission.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from qosgate.config import QosConfig
from qosgate.runtime.batches.feeder import LineAnswer
from qosgate.runtime.batches.records import BatchRecord, LineTask
from qosgate.server.asgi import Message, Receive, Scope, Send
from qosgate.server.auth import BATCH_LINE
from qosgate.server.flow import RequestFlow
from qosgate.wire.engine_request import Route

__all__ = ["FlowLines"]

_ROUTES: dict[str, Route | None] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    "/v1/embeddings": None,  # the embeddings flow
}


def _retry_after(value: bytes) -> float | None:
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: treated as no hint


class FlowLines:
    """The feeder's ``LineRunner`` over ``flow``; ``cfg`` names each tenant's keys."""

    def __init__(self, flow: RequestFlow, cfg: QosConfig) -> None:
        self.flow = flow
        self._cfg = cfg
        self._keys = self._first_keys(cfg)

    @staticmethod
    def _first_keys(cfg: QosConfig) -> dict[str, str]:
        """A tenant's first key speaks for its jobs (its limits and share are the tenant's)."""
        return {t.name: t.api_keys[0] for t in cfg.tenants if t.api_keys}

    def _key_of(self, tenant: str) -> str | None:
        """The key a job's lines go with, from the tenants in force (a reload changes them)."""
        cfg = self.flow.scheduler.cfg
        if cfg is not self._cfg:
            self._cfg, self._keys = cfg, self._first_keys(cfg)
        return self._keys.get(tenant)

    def _call(self, url: str) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
        route = _ROUTES.get(url, "chat")
        if url not in _ROUTES:
            raise ValueError(f"not a batch endpoint: {url}")
        if route is None:
            return self.flow.embeddings
        flow = self.flow

        def complete(scope: Scope, receive: Receive, send: Send) -> Awaitable[None]:
            return flow.complete(scope, receive, send, route)

        return complete

    async def __call__(self, job: BatchRecord, task: LineTask,
                       stop: asyncio.Event) -> LineAnswer:
        headers: list[tuple[bytes, bytes]] = [
            (b"content-type", b"application/json"),
            (b"x-qos-class", job.qos_class.encode("latin-1")),
        ]
        key = self._key_of(job.tenant)
        if key is not None:
            headers.append((b"authorization", b"Bearer " + key.encode("latin-1")))
        scope: Scope = {
            "type": "http", "method": "POST", "path": task.url, "raw_path": task.url.encode(),
            "query_string": b"", "headers": headers, "http_version": "1.1", "scheme": "http",
            "client": None, "server": None, BATCH_LINE: True,
        }
        sent_body = [False]

        async def receive() -> Message:
            if not sent_body[0]:
                sent_body[0] = True
                return {"type": "http.request", "body": task.body, "more_body": False}
            await stop.wait()
            return {"type": "http.disconnect"}

        status: list[int] = []
        retry_after: list[float | None] = [None]
        request_id = [""]
        parts: list[bytes] = []

        async def send(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                status.append(int(msg["status"]))
                for k, v in msg.get("headers", ()):
                    if k == b"retry-after":
                        retry_after[0] = _retry_after(bytes(v))
                    elif k == b"x-qosgate-request-id":
                        request_id[0] = bytes(v).decode("latin-1")
            elif msg["type"] == "http.response.body":
                parts.append(bytes(msg.get("body", b"")))

        await self._call(task.url)(scope, receive, send)
        if not status:  # stopped before any answer (the flow answers nobody who left)
            return LineAnswer(None, request_id=request_id[0])
        return LineAnswer(status[0], b"".join(parts), retry_after[0], request_id[0])
