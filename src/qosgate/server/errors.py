"""Outcomes to HTTP: OpenAI error JSON (``{"error": {"message", "type", "param", "code"}}``),
the status for each core reason, and ``Retry-After`` (whole seconds, rounded up)."""

from __future__ import annotations

import math

from qosgate.config import QosConfig, RateLimits
from qosgate.core import Request, State
from qosgate.core.admission import OverLimit
from qosgate.core.model_limits import MODEL_REASONS, limited_model
from qosgate.core.reasons import Reason, upstream_status
from qosgate.core.weights import ModelWeights
from qosgate.wire.errors import error_json
from qosgate.wire.sse import Headers

# reason -> (status, OpenAI error type, message)
_REASONS: dict[str, tuple[int, str, str]] = {
    "invalid_api_key": (401, "invalid_request_error", "Incorrect or missing API key."),
    "class_not_allowed": (
        403, "permission_error", "The tenant may not use this class (its allowed_classes)."
    ),
    "model_not_found": (404, "invalid_request_error", "The model does not exist."),
    # 400, not 413: what vLLM and OpenAI answer a prompt too long for the model, so the openai
    # client raises the same BadRequestError either way (413 is for a body too large in bytes)
    "prompt_too_long": (400, "invalid_request_error", "The prompt is over the configured limit."),
    "body_too_large": (413, "invalid_request_error", "The request body is too large."),
    "invalid_max_tokens": (
        400,
        "invalid_request_error",
        "max_tokens must be at least 1 and at most the configured limit.",
    ),
    "rate_limit_requests": (
        429, "rate_limit_error",
        "The tenant's request rate limit is reached (shared by all its API keys).",
    ),
    "rate_limit_tokens": (
        429, "rate_limit_error",
        "The tenant's token rate limit is reached (shared by all its API keys).",
    ),
    "concurrency_limit": (
        429, "rate_limit_error",
        "The tenant's concurrent request limit is reached (shared by all its API keys).",
    ),
    "model_rate_limit_requests": (
        429, "rate_limit_error",
        "The tenant's request rate limit on this model is reached (shared by all its API keys).",
    ),
    "model_rate_limit_tokens": (
        429, "rate_limit_error",
        "The tenant's token rate limit on this model is reached (shared by all its API keys).",
    ),
    "model_concurrency_limit": (
        429, "rate_limit_error",
        "The tenant's concurrent request limit on this model is reached (shared by all its API "
        "keys).",
    ),
    "shared_state_unavailable": (
        503,
        "overloaded_error",
        "The shared tenant state is unreachable and this gateway fails closed.",
    ),
    "class_queue_full": (503, "overloaded_error", "The queue of this class is full."),
    "queue_full": (503, "overloaded_error", "The gateway queue is full."),
    "displaced": (503, "overloaded_error", "Shed to make room for more urgent requests."),
    "deadline_infeasible": (
        503,
        "overloaded_error",
        "The request cannot start within its latency budget.",
    ),
    "overloaded": (
        503,
        "overloaded_error",
        "The queue ahead would not drain within what this class promises; retry after the "
        "time given.",
    ),
    "shutting_down": (503, "overloaded_error", "The gateway is shutting down."),
    "server_shutdown": (503, "overloaded_error", "The gateway shut down."),
    "queue_timeout": (504, "timeout_error", "The request waited too long in the queue."),
    "upstream_unreachable": (502, "server_error", "No engine could be reached."),
    "upstream_disconnected": (502, "server_error", "The engine closed the connection."),
    "upstream_bad_response": (502, "server_error", "The engine's answer was not valid HTTP."),
    "engine_error": (500, "server_error", "The engine failed."),
    "engine_stalled": (502, "server_error",
                       "The engine stalled: it held requests and produced no token."),
    "no_replica_available": (
        503,
        "overloaded_error",
        "No engine serving this model is up at the moment.",
    ),
    "model_unavailable": (
        503,
        "overloaded_error",
        "The engines are not ready yet (still starting or unreachable).",
    ),
    "first_byte_timeout": (504, "timeout_error", "The engine sent nothing in time."),
    "idle_timeout": (504, "timeout_error", "The engine went silent mid-stream."),
    "total_timeout": (504, "timeout_error", "The engine call ran past its time limit."),
    "engine_rejected": (400, "invalid_request_error", "The engine cannot serve this request."),
    "client_disconnected": (499, "cancelled", "The client went away."),
    # the request itself, refused before the scheduler (wire/parse.py, server/protocol.py)
    "invalid_json": (400, "invalid_request_error", "Malformed JSON body."),
    "invalid_body": (400, "invalid_request_error", "Invalid request body."),
    "invalid_utf8": (400, "invalid_request_error", "The request body is not valid UTF-8."),
    "json_too_deep": (400, "invalid_request_error", "The JSON body is nested too deeply."),
    "duplicate_key": (
        400,
        "invalid_request_error",
        "A member the gateway acts on appears twice or with an escaped key.",
    ),
    "invalid_session": (400, "invalid_request_error",
                        "The session header must be a short printable ASCII string."),
    "body_timeout": (408, "timeout_error", "The request body did not arrive in time."),
    "internal_error": (500, "server_error", "The gateway failed on this request."),
}

def own_statuses() -> dict[str, int]:
    """The status of each code the gateway sends itself: the HTTP reference's errors table is
    checked against it (``tests/server/test_error_codes_doc.py``), so the two cannot drift."""
    return {reason: status for reason, (status, _, _) in _REASONS.items()}


RETRY_STATUSES = frozenset({429, 503})
TEXT_ESTIMATE = "estimated as characters / 4"  # how a text's tokens are counted


def retry_after_header(seconds: float | None) -> Headers:
    """``Retry-After`` in whole seconds, rounded up (HTTP has no other), and, when the time is
    known, ``retry-after-ms`` to the millisecond (the openai SDK reads it first): a booking's
    time (``core.bookings``) is to the millisecond, and retries told the same second would
    land together."""
    if seconds is None:
        return [(b"retry-after", b"1")]
    return [(b"retry-after", str(max(1, math.ceil(seconds))).encode()),
            (b"retry-after-ms", str(max(1, round(seconds * 1000))).encode())]


def reason_error(
    reason: str, message: str | None = None, param: str | None = None
) -> tuple[int, bytes]:
    """(status, body) for a reason refused before or by the scheduler."""
    status, type_, default = _REASONS.get(reason, (400, "invalid_request_error", reason))
    return status, error_json(message or default, type_, reason, param)


def over_limit_message(
    over: OverLimit, subject: str, service_class: str, how: str = TEXT_ESTIMATE
) -> str:
    """The words of a refusal by a size limit (``core.admission.over_limit``): ``subject`` is
    what broke it (the prompt, or the output member the client sent), ``how`` how a prompt's
    tokens were counted."""
    if over.reason == Reason.PROMPT_TOO_LONG:
        return (f"{subject} is about {over.value} tokens ({how}), over the limit of "
                f"{over.limit} tokens.")
    whose = f" (the output ceiling of class {service_class} or its tenant)" if over.ceiling else ""
    return f"{subject} is {over.value}; it must be between 1 and {over.limit}{whose}."


def limit_message(
    reason: str, req: Request, cfg: QosConfig | None
) -> tuple[str | None, str | None]:
    """(message, param) for a refusal by a tenant's configured limit, saying the limit (None: the
    default message). (A size limit never gets here: ``server.prepare`` refuses it first, with
    ``over_limit_message``.)"""
    if cfg is None:
        return None, None
    tenant = next((t for t in cfg.tenants if t.name == req.tenant), None)
    if tenant is None:
        return None, None
    lim: RateLimits = tenant.limits
    key = "limits"
    on = ""
    if reason in MODEL_REASONS:
        model = limited_model(tenant.limits.models, req.model,
                              ModelWeights(cfg.models).base_of)
        if model is None:
            return None, None
        lim = tenant.limits.models[model]
        key = f"limits.models.{model}"
        on = f" on model {model!r}" + (
            f" (which {req.model!r}, its adapter, counts against)" if model != req.model else "")
        reason = reason.removeprefix("model_")
    bucket = "a token bucket: up to a minute's worth at once, refilled continuously"
    # the limits are the tenant's, whichever of its keys the request came with
    whose = f"Tenant {tenant.name!r} reached its"
    shared = "shared by all its API keys"
    if reason == "rate_limit_requests" and lim.requests_per_minute:
        return (
            f"{whose} request rate limit{on} ({key}.requests_per_minute): "
            f"{lim.requests_per_minute:g} requests per minute, {shared} ({bucket}).",
            None,
        )
    if reason == "rate_limit_tokens" and lim.tokens_per_minute:
        return (
            f"{whose} token rate limit{on} ({key}.tokens_per_minute): "
            f"{lim.tokens_per_minute:g} tokens per minute, {shared} ({bucket}); this request "
            f"counts {req.prompt_tokens} prompt tokens (estimated) plus its expected output.",
            None,
        )
    if reason == "concurrency_limit" and lim.max_concurrent:
        return (
            f"{whose} concurrency limit{on} ({key}.max_concurrent): at most "
            f"{lim.max_concurrent} requests at once, {shared}.",
            None,
        )
    return None, None


def outcome_error(req: Request, cfg: QosConfig | None = None) -> tuple[int, bytes, Headers]:
    """(status, body, extra headers) for a request that ended without a response; with ``cfg``,
    a refusal by a configured limit says the limit."""
    reason = req.reason
    code = upstream_status(reason)
    if code is not None:
        # an engine's error that no retry could get past (a 4xx is passed on by the engine
        # call itself): 429/503 stay back-pressure with the engine's Retry-After, 5xx are 502
        if code in RETRY_STATUSES:
            msg = f"The engines are overloaded (they answered {code})."
            body = error_json(msg, "overloaded_error", reason)
            return 503, body, retry_after_header(req.retry_after)
        msg = f"The engine failed (it answered {code})."
        return 502, error_json(msg, "server_error", reason), []
    if reason in _REASONS:
        status, body = reason_error(reason, *limit_message(reason, req, cfg))
    elif req.state is State.TIMED_OUT:
        status, body = 504, error_json("Timed out.", "timeout_error", reason)
    elif req.state is State.REJECTED:
        status, body = 503, error_json("Refused: " + reason, "overloaded_error", reason)
    else:
        status, body = 500, error_json("Failed: " + reason, "server_error", reason)
    headers = retry_after_header(req.retry_after) if status in RETRY_STATUSES else []
    return status, body, headers
