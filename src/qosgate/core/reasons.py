"""Why a request ended (``Request.reason``): one ``StrEnum`` instead of bare strings.

The values are the strings the metrics, the JSON results and the error bodies have always
carried, so a label or a document does not change; a member *is* its string. Drivers may still
pass a reason the core does not name (an engine's own words): ``Request.reason`` stays a ``str``.

Two reasons carry data, and the helpers here read it instead of every caller parsing strings: a
timeout of any kind (``is_timeout``) and an engine's HTTP status (``upstream``/``upstream_status``).
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    # the one good ending
    COMPLETED = "completed"
    # refused at admission
    PROMPT_TOO_LONG = "prompt_too_long"
    INVALID_MAX_TOKENS = "invalid_max_tokens"
    NO_REPLICA_AVAILABLE = "no_replica_available"
    RATE_LIMIT_REQUESTS = "rate_limit_requests"
    RATE_LIMIT_TOKENS = "rate_limit_tokens"
    CONCURRENCY_LIMIT = "concurrency_limit"
    # the same, by a tenant's limit on the request's model (``core.model_limits``)
    MODEL_RATE_LIMIT_REQUESTS = "model_rate_limit_requests"
    MODEL_RATE_LIMIT_TOKENS = "model_rate_limit_tokens"
    MODEL_CONCURRENCY_LIMIT = "model_concurrency_limit"
    CLASS_QUEUE_FULL = "class_queue_full"
    DEADLINE_INFEASIBLE = "deadline_infeasible"
    OVERLOADED = "overloaded"
    QUEUE_FULL = "queue_full"
    # taken off the queue
    DISPLACED = "displaced"
    QUEUE_TIMEOUT = "queue_timeout"
    PREEMPTED = "preempted"
    SHUTTING_DOWN = "shutting_down"
    # ended by the client or the server
    CLIENT_DISCONNECTED = "client_disconnected"
    SERVER_SHUTDOWN = "server_shutdown"
    # an engine call's end (the drivers' words)
    FIRST_BYTE_TIMEOUT = "first_byte_timeout"
    IDLE_TIMEOUT = "idle_timeout"
    TOTAL_TIMEOUT = "total_timeout"
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    UPSTREAM_DISCONNECTED = "upstream_disconnected"
    UPSTREAM_BAD_RESPONSE = "upstream_bad_response"
    UPSTREAM_ERROR = "upstream_error"
    ENGINE_STALLED = "engine_stalled"  # its token counters stood still while it held work


TIMEOUTS = frozenset(
    {Reason.QUEUE_TIMEOUT, Reason.FIRST_BYTE_TIMEOUT, Reason.IDLE_TIMEOUT, Reason.TOTAL_TIMEOUT}
)

_UPSTREAM = "upstream_"


def is_timeout(reason: str) -> bool:
    """A bound on time ran out (the request ends ``timed_out`` rather than ``failed``)."""
    return reason in TIMEOUTS


def upstream(status: int) -> str:
    """The reason for an engine that answered with HTTP ``status`` (``upstream_503``)."""
    return f"{_UPSTREAM}{status}"


def upstream_status(reason: str) -> int | None:
    """The HTTP status an ``upstream(status)`` reason carries; None for any other reason."""
    if reason.startswith(_UPSTREAM):
        code = reason[len(_UPSTREAM):]
        if code.isdigit():
            return int(code)
    return None
