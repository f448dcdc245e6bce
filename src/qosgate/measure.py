"""The measuring client: one streamed OpenAI request sent, each token chunk timed as it arrives,
the usage read, and what became of the request (``Answer``). ``qosgate replay`` sends its
workload through it and ``qosgate calibrate`` its probe.

Asyncio on the runtime's own upstream transport, not a thread per request: replay keeps
hundreds of requests open at once, each sent at its planned instant, which one event loop does
with a timer per request and no thread per connection; calibrate's n requests "released
together" are n sends started in the same turn of the loop (no barrier needed), and the
transport decodes chunked streams and keeps connections alive for both.

Times are read on an injected ``clock`` at each socket read, relative to ``t0``, so TTFT and
TPOT are the client's own. A choice holds a token when it carries text (``text``, or a chat
``delta.content``), or does not end the stream, or is the stream's first: a random token id
may decode to no text, while a textless chunk that only closes a stream after its tokens
(``finish_reason`` on a chunk of its own, as the stand-in sends it) and chat's opening role
event are no token.

Outcomes follow the gateway's: 200 and a whole stream is ``completed``; a 429/503 refusal is
``rejected`` with its ``error.code`` as the reason and its ``Retry-After``; a 504 or a timeout
code is ``timed_out``; an error event mid-stream ends the request with that event's code; a
broken connection or any other status is ``failed``. A request the caller stops waiting for
(cancelled) is ``cancelled`` (``client_disconnected``, as the gateway counts a client that hung
up).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from qosgate.core.reasons import is_timeout
from qosgate.runtime.upstream.transport import Connection, Pool, UpstreamError

REFUSALS = frozenset({429, 503})

Clock = Callable[[], float]


@dataclass(slots=True)
class Answer:
    status: int = 0
    state: str = "failed"
    reason: str = ""
    param: str = ""  # the error's ``param``, where it names one
    retry_after: float | None = None
    detail: str = ""  # for a message: a non-200 answer's body (its head), a connection's error
    sent_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float = 0.0
    prompt_tokens: int = 0  # the usage's, 0 where it gives none
    output_tokens: int = 0  # the usage's, else the token chunks counted
    chunk_times: list[float] = field(default_factory=list)  # each token chunk's arrival


def _error(raw: bytes) -> dict[str, Any]:
    try:
        err = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return {}
    return err if isinstance(err, dict) else {}


def _error_code(raw: bytes) -> str:
    err = _error(raw)
    code = err.get("code") or err.get("type")
    return str(code) if code else ""


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


def _is_token(choice: dict[str, Any], first: bool) -> bool:
    delta = choice.get("delta")
    if delta is not None and delta.get("content") in (None, "") and "role" in delta:
        return False  # chat's opening role event: no token yet
    text = choice.get("text") if delta is None else delta.get("content")
    return bool(text) or choice.get("finish_reason") is None or first


class _Stream:
    """Reads SSE events off the connection: token chunks, the usage, an error."""

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
        if usage:
            self.ans.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            if usage.get("completion_tokens") is not None:
                self.usage = int(usage["completion_tokens"])
        for ch in doc.get("choices") or ():
            if _is_token(ch, not self.ans.chunk_times):
                if self.ans.first_token_at is None:
                    self.ans.first_token_at = now - self.t0
                self.ans.chunk_times.append(now - self.t0)


async def send(pool: Pool, head: bytes, body: bytes, t0: float, ans: Answer,
               clock: Clock = time.monotonic) -> None:
    """Send one request and fill ``ans`` as its answer arrives (cancel the task to give up:
    ``ans`` then says how far it got)."""
    conn: Connection | None = None
    ans.sent_at = clock() - t0
    try:
        conn = await pool.request(head, body)
        ans.status = conn.status
        if conn.status != 200:
            raw = await conn.read_all()
            _ended(ans, conn.status, _error_code(raw))
            ans.param = str(_error(raw).get("param") or "")
            ans.retry_after = _retry_after(conn.retry_after)
            ans.detail = raw[:500].decode("utf-8", "replace")
            return
        stream = _Stream(ans, t0)
        while not stream.done:
            data = await conn.read_some()
            if not data:
                break
            stream.feed(data, clock())
        if ans.state == "failed" and not ans.reason:  # no error event
            if stream.done or conn.complete:
                ans.state, ans.reason = "completed", "completed"
            else:
                ans.reason = "upstream_disconnected"
        ans.output_tokens = (stream.usage if stream.usage is not None
                             else len(ans.chunk_times))
        if stream.done and not conn.complete:
            await conn.read_all()  # the chunked body's end, so the connection is reusable
    except (UpstreamError, OSError) as exc:
        ans.state, ans.reason, ans.detail = "failed", "connection_error", str(exc)
    except asyncio.CancelledError:
        ans.state, ans.reason = "cancelled", "client_disconnected"
        if conn is not None:
            conn.close()
            conn = None
        raise
    finally:
        ans.finished_at = clock() - t0
        if conn is not None:
            pool.release(conn)
