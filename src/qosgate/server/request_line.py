"""One line of the request log (``RequestLine``): what an operator asks of one request that
ended -- who sent it, where it ran, how it ended and why, how long it waited -- and which
requests get one (``wanted``).

Pure: values in, a line out; ``server/request_log.py`` writes them. A request the scheduler had
is described from its core ``Request`` (``core_line``); one refused before it reached the
scheduler (a bad key, a bad body, an unknown model, a draining gateway) from what the flow knew
of it by then (``gateway_line``).
"""

from __future__ import annotations

import zlib
from datetime import UTC, datetime

import msgspec

from qosgate.core import Request, State
from qosgate.core.reasons import Reason

# outcomes that are an error for the client: a refusal, a timeout, a failure
ERROR_OUTCOMES = frozenset({State.REJECTED, State.TIMED_OUT, State.FAILED})
_HASH_SPAN = 1 << 32  # crc32's range


class RequestLine(msgspec.Struct, kw_only=True):
    """The fields of one line, in the order they are written. Times are seconds from the
    request's arrival at the gateway; None where the request never got that far."""

    ts: str  # when the line was written (UTC, ISO 8601)
    id: str  # x-qosgate-request-id, and X-Request-Id at the engine
    tenant: str
    service_class: str = msgspec.field(name="class")
    model: str | None
    replica: str | None  # where its last attempt ran
    route: str | None  # chat, completions or embeddings
    outcome: str  # completed, rejected, timed_out, cancelled or failed
    reason: str | None  # why: qosgate_requests_total's reason (completed: "completed")
    status: int | None  # the HTTP status its client got (None: it left before any)
    queue_wait_s: float | None
    ttft_s: float | None
    duration_s: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    failed_attempts: int  # engine calls that failed before the first byte (each may be retried)
    preemptions: int  # times it was pulled back or paused for a more urgent request
    client_request_id: str | None = None  # the client's own X-Request-Id, as it sent it


_encode = msgspec.json.Encoder().encode


def encoded(line: RequestLine) -> bytes:
    """The line as written: one JSON object, no newline."""
    return _encode(line)


def sampled(rid: str, share: float) -> bool:
    """Whether request ``rid`` falls in the sampled ``share`` of requests: a hash of its id, not
    a random draw, so the same id is chosen the same way in every run and every worker."""
    if share >= 1.0:
        return True
    if share <= 0.0:
        return False
    return zlib.crc32(rid.encode()) < share * _HASH_SPAN


def is_error(outcome: str, reason: str | None) -> bool:
    """Refused, timed out, failed, or cancelled by the gateway (a client that left is not)."""
    return outcome in ERROR_OUTCOMES or (outcome == State.CANCELLED
                                         and reason != Reason.CLIENT_DISCONNECTED)


def wanted(rid: str, outcome: str, reason: str | None, errors: bool, share: float) -> bool:
    """Whether a request that ended so gets its line: an error when ``errors`` is on, any
    other in the sampled ``share``."""
    if is_error(outcome, reason):
        return errors
    return sampled(rid, share)


def timestamp(wall: float) -> str:
    """``wall`` (seconds since the epoch) as UTC ISO 8601 to the millisecond."""
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def _since(start: float, at: float | None) -> float | None:
    return None if at is None else round(at - start, 6)


def core_line(req: Request, route: str | None, status: int | None, wall: float,
              client_id: str | None = None) -> RequestLine:
    """The line of a request the scheduler had, once it reached its terminal state."""
    started = req.dispatched_at is not None
    return RequestLine(
        ts=timestamp(wall), id=req.id, tenant=req.tenant, service_class=req.service_class,
        model=req.model or None, replica=req.replica, route=route, outcome=req.state.value,
        reason=req.reason or None, status=status,
        queue_wait_s=_since(req.arrival, req.dispatched_at),
        ttft_s=_since(req.arrival, req.first_token_at),
        duration_s=_since(req.arrival, req.finished_at),
        prompt_tokens=req.prompt_tokens,
        completion_tokens=req.output_tokens if started else None,
        failed_attempts=req.failures, preemptions=req.preemptions,
        client_request_id=client_id,
    )


def gateway_line(rid: str, tenant: str, service_class: str, route: str | None, outcome: str,
                 reason: str, status: int | None, duration_s: float, wall: float,
                 client_id: str | None = None) -> RequestLine:
    """The line of a request that ended before it reached the scheduler."""
    return RequestLine(
        ts=timestamp(wall), id=rid, tenant=tenant, service_class=service_class, model=None,
        replica=None, route=route, outcome=outcome, reason=reason, status=status,
        queue_wait_s=None, ttft_s=None, duration_s=round(duration_s, 6), prompt_tokens=None,
        completion_tokens=None, failed_attempts=0, preemptions=0, client_request_id=client_id,
    )
