"""One replayed request over the wire: sent, its stream read as it arrives, and what became of
it (``Answer``). Times are read from ``time.monotonic`` at each socket read, relative to the
replay's start, so TTFT and TPOT are the client's own.

Outcomes follow the gateway's: 200 and a whole stream is ``completed``; a 429/503 refusal is
``rejected`` with its ``error.code`` as the reason and its ``Retry-After``; a 504 or a timeout
code is ``timed_out``; an error event mid-stream ends the request with that event's code; a
broken connection or any other status is ``failed``. A request the replay stops waiting for
(``--max-seconds``, or its own timeout) is ``cancelled`` (``client_disconnected``, as the
gateway counts a client that hung up).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

from qosgate.core.reasons import is_timeout
from qosgate.runtime.upstream.transport import Connection, Pool, UpstreamError

REFUSALS = frozenset({429, 503})


@dataclass(slots=True)
class Answer:
    status: int = 0
    state: str = "failed"
    reason: str = ""
    param: str = ""  # the error's ``param``, where it names one
    retry_after: float | None = None
    first_token_at: float | None = None
    finished_at: float = 0.0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # each content event's arrival


def _error_code(raw: bytes) -> str:
    try:
        err = json.loads(raw)["error"]
        code = err.get("code") or err.get("type")
        return str(code) if code else ""
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""


def _error_param(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"].get("param") or "")
    except (ValueError, KeyError, TypeError, AttributeError):
        return ""


def _retry_after(raw: bytes | None) -> float | None:
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        return None


def _ended(ans: Answer, status: int, code: str) -> None:
    """A non-2xx status or an error event: the outcome and reason, as the gateway's."""
    ans.status = status
    if status in REFUSALS:
        ans.state, ans.reason = "rejected", code or f"http_{status}"
    elif status == 504 or is_timeout(code):
        ans.state, ans.reason = "timed_out", code or "timeout"
    else:
        ans.state, ans.reason = "failed", code or f"http_{status}"


class _Stream:
    """Reads SSE events off the connection: content events, the usage, an error."""

    def __init__(self, ans: Answer, t0: float) -> None:
        self.ans = ans
        self.t0 = t0
        self.buf = b""
        self.done = False
        self.usage: int | None = None

    def feed(self, data: bytes, now: float) -> None:
        self.buf += data
        while b"\n\n" in self.buf:
            ev, _, self.buf = self.buf.partition(b"\n\n")
            for line in ev.split(b"\n"):
                if line.startswith(b"data:"):
                    self._event(line[5:].strip(), now)

    def _event(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.done = True
            return
        try:
            doc = json.loads(payload)
        except ValueError:
            return
        if "error" in doc:
            _ended(self.ans, self.ans.status, _error_code(payload))
            self.done = True
            return
        usage = doc.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.usage = int(usage["completion_tokens"])
        for ch in doc.get("choices") or ():
            delta = ch.get("delta")
            if delta is not None and delta.get("content") in (None, "") and "role" in delta:
                continue  # chat's opening role event: no token yet
            if "text" in ch or (delta is not None and delta.get("content") is not None):
                if self.ans.first_token_at is None:
                    self.ans.first_token_at = now - self.t0
                self.ans.chunk_times.append(now - self.t0)


async def send(pool: Pool, head: bytes, body: bytes, t0: float, ans: Answer) -> None:
    """Send one request and fill ``ans`` as its answer arrives (cancel the task to give up:
    ``ans`` then says how far it got)."""
    conn: Connection | None = None
    try:
        conn = await pool.request(head, body)
        ans.status = conn.status
        if conn.status != 200:
            raw = await conn.read_all()
            _ended(ans, conn.status, _error_code(raw))
            ans.param = _error_param(raw)
            ans.retry_after = _retry_after(conn.retry_after)
            return
        stream = _Stream(ans, t0)
        while not stream.done:
            data = await conn.read_some()
            if not data:
                break
            stream.feed(data, time.monotonic())
        if ans.state == "failed" and not ans.reason:  # no error event
            if stream.done or conn.complete:
                ans.state, ans.reason = "completed", "completed"
            else:
                ans.reason = "upstream_disconnected"
        ans.output_tokens = (stream.usage if stream.usage is not None
                             else len(ans.chunk_times))
        if stream.done and not conn.complete:
            await conn.read_all()  # the chunked body's end, so the connection is reusable
    except (UpstreamError, OSError):
        ans.state, ans.reason = "failed", "connection_error"
    except asyncio.CancelledError:
        ans.state, ans.reason = "cancelled", "client_disconnected"
        if conn is not None:
            conn.close()
            conn = None
        raise
    finally:
        ans.finished_at = time.monotonic() - t0
        if conn is not None:
            pool.release(conn)
