"""Server-sent events as OpenAI streams them: ``data:`` events, the closing ``[DONE]``, an error
as the stream's last event, and the headers of both response kinds."""

from __future__ import annotations

from qosgate.wire.errors import error_json

Headers = list[tuple[bytes, bytes]]

JSON_HEADERS: Headers = [(b"content-type", b"application/json")]
SSE_HEADERS: Headers = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]

DATA = b"data: "  # a data line's field name, before its payload
EVENT_END = b"\n\n"  # ends an event (its last line, then an empty one)
DONE_LINE = DATA + b"[DONE]"
DONE = DONE_LINE + EVENT_END
KEEPALIVE = b": keep-alive" + EVENT_END


def event(data: bytes) -> bytes:
    """One event carrying ``data`` (a JSON document; each of its lines a ``data:`` line)."""
    lines = data.strip().splitlines() or [b"{}"]
    return b"".join(DATA + line + b"\n" for line in lines) + b"\n"


def json_event(payload: bytes) -> bytes:
    """One event carrying a one-line payload (a JSON document as msgspec encodes it, with no
    newline in it): ``event`` without its line split, for the per-token path."""
    return DATA + payload + EVENT_END


def error_end(body: bytes) -> bytes:
    """An error body (``wire.errors``) as a stream's last events: the error event, then
    ``[DONE]`` (the ``openai`` client raises ``APIError`` on such an event)."""
    return event(body) + DONE


def error_event(message: str, type_: str, code: str | int | None,
                param: str | None = None) -> bytes:
    """An error event alone, for a stream that goes on to close itself."""
    return event(error_json(message, type_, code, param))
