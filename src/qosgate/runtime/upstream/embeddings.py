"""``/v1/embeddings`` at an upstream: a batch of clients' requests merged into as few engine calls
as their models and kinds of input allow, and each client answered with its own share."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import msgspec

from qosgate.core.facts import AttemptFailed
from qosgate.runtime.embeddings import deliver
from qosgate.runtime.ports import Call
from qosgate.runtime.upstream.errors import error_status
from qosgate.runtime.upstream.transport import Connection, Pool, refused_connection
from qosgate.wire.embeddings import apportion, pooled

log = logging.getLogger("qosgate.upstream")
BAD_RESPONSE = AttemptFailed("upstream_bad_response")  # an answer that could not be read


class UpstreamEmbeddings:
    """Serves batches of embeddings requests (``runtime/batching.py``) at one upstream."""

    def __init__(self, pool: Pool, head: bytes, total_timeout_s: float, base: str) -> None:
        self.pool = pool
        self.head = head  # the prebuilt ``POST /v1/embeddings`` head
        self.total_timeout_s = total_timeout_s
        self.base = base

    async def run_batch(self, calls: list[Call]) -> None:
        """Those that can share an upstream call (same model, dimensions and kind of input) go
        as one ``/v1/embeddings`` with their inputs in one list; the answer is split back, each
        client its own vectors in order and its share of the usage."""
        groups: dict[tuple[str, int | None, bool], list[Call]] = {}
        for c in calls:
            j = c.engine_request
            kind = bool(j.inputs) and isinstance(j.inputs[0], list)  # type: ignore[index]
            groups.setdefault((j.model, j.dimensions, kind), []).append(c)
        await asyncio.gather(*(self._embed(g) for g in groups.values()))

    async def _embed(self, calls: list[Call]) -> None:
        first = calls[0].engine_request
        inputs: list[Any] = []
        for c in calls:
            inputs.extend(c.engine_request.inputs or [])
        req: dict[str, Any] = {"model": first.model, "input": inputs, "encoding_format": "float"}
        if first.dimensions is not None:
            req["dimensions"] = first.dimensions
        conn: Connection | None = None
        try:
            async with asyncio.timeout(self.total_timeout_s):
                conn = await self.pool.request(self.head, msgspec.json.encode(req))
                data = await conn.read_all()
            status = conn.status
            ctype = conn.content_type or b"application/json"
            retry_after = conn.retry_after
            self.pool.release(conn)
            conn = None
        except (TimeoutError, OSError) as exc:
            log.warning("upstream %s: embeddings: %s", self.base, exc)
            if conn is not None:
                conn.close()
            refused = refused_connection(exc)
            reason = ("first_byte_timeout" if isinstance(exc, TimeoutError) else
                      "upstream_unreachable")
            failed = AttemptFailed(reason, unreachable=refused)
            for c in calls:
                c.attempt_failed(failed)
            return
        except BaseException:
            if conn is not None:
                conn.close()
            raise
        if status >= 400:
            if status >= 500 or status == 429 or len(calls) == 1:
                for c in calls:  # back-pressure, an engine fault, or one client's own answer
                    error_status(c, status, data, ctype, retry_after)
            else:  # one of them is at fault: each on its own, to answer each as it deserves
                await asyncio.gather(*(self._embed([c]) for c in calls))
            return
        try:
            doc = msgspec.json.decode(data)
            rows = sorted(doc["data"], key=lambda r: r["index"])
            vectors = [pooled(r["embedding"]) for r in rows]
            if len(vectors) != len(inputs):
                raise ValueError("wrong number of embeddings")
            usage = doc.get("usage") or {}
            total = usage.get("prompt_tokens")
        except (msgspec.DecodeError, KeyError, TypeError, ValueError) as exc:
            log.warning("upstream %s: embeddings answer unreadable: %s", self.base, exc)
            for c in calls:
                c.attempt_failed(BAD_RESPONSE)
            return
        weights = [c.engine_request.prompt_tokens for c in calls]
        shares = apportion(int(total), weights) if isinstance(total, int) else weights
        model = doc.get("model") or first.model
        at = 0
        for c, share in zip(calls, shares, strict=True):
            n = len(c.engine_request.inputs or [])
            await deliver(c, model, vectors[at:at + n], share)
            at += n

