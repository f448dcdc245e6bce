"""An engine's error answer (status >= 400, before anything reached the client): what the core is
told (``error_status``) and what the client gets (``error_body``, always OpenAI's error format)."""

from __future__ import annotations

import msgspec

from qosgate.core.facts import AttemptFailed
from qosgate.core.reasons import upstream
from qosgate.runtime.ports import Call
from qosgate.wire.errors import error_json


def error_status(call: Call, status: int, data: bytes, ctype: bytes | None,
                 retry_after: bytes | None) -> None:
    """An engine's error answer (status >= 400), before anything reached the client."""
    if status in (429, 503):  # back-pressure: cool this replica, try another
        call.attempt_failed(AttemptFailed(upstream(status), backpressure=True,
                                          retry_after=retry_after_s(retry_after)))
    elif status >= 500:
        call.attempt_failed(AttemptFailed(upstream(status)))
    else:  # the engine's judgement of the request itself: the client's answer
        call.refused(status, error_body(status, data, ctype))


def retry_after_s(value: bytes | None) -> float | None:
    """An HTTP ``Retry-After`` in seconds (the delta-seconds form; a date is not trusted)."""
    if value is None:
        return None
    try:
        secs = float(value.strip())
    except ValueError:
        return None
    return secs if secs >= 0 else None


def error_body(status: int, data: bytes, ctype: bytes | None) -> bytes:
    """An engine's error body as the client gets it: passed on byte for byte if it is already
    in OpenAI's format (vLLM's ``code`` is then its HTTP status, a number: what the client
    would get straight from vLLM), else wrapped in it (an HTML 500 page is no answer for an
    OpenAI client). The wrapping is qosgate's own body, so its ``code`` follows qosgate's rule:
    a string naming the reason, as in the metrics (``upstream_<status>``)."""
    if ctype is not None and b"json" in ctype.lower():
        try:
            doc = msgspec.json.decode(data)
        except msgspec.DecodeError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            return data
        if isinstance(doc, dict) and isinstance(doc.get("message"), str):  # FastAPI-style
            text = doc["message"]
        elif isinstance(doc, dict) and "detail" in doc:
            text = str(doc["detail"])
        else:
            text = data.decode("utf-8", "replace")[:500]
    else:
        text = data.decode("utf-8", "replace")[:500]
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return error_json(f"The engine answered {status}: {text.strip()}", kind, upstream(status))

