"""OpenAI's error body, the one place it is built: ``{"error": {"message", "type", "param",
"code"}}``, every member always present (the ``openai`` client reads ``param`` and ``code``, and
vLLM sends all four)."""

from __future__ import annotations

import msgspec

_encode = msgspec.json.Encoder().encode


def error_object(
    message: str, type_: str, code: str | int | None = None, param: str | None = None
) -> dict[str, dict[str, object]]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_json(
    message: str, type_: str, code: str | int | None = None, param: str | None = None
) -> bytes:
    return _encode(error_object(message, type_, code, param))


def invalid_request(message: str, param: str | None = None,
                    code: str | int = "invalid_request") -> bytes:
    """A 400's body: the request itself is at fault (``param`` names the member)."""
    return error_json(message, "invalid_request_error", code, param)
