"""The hot-path request reader: only the fields the scheduler needs, and the priority splice.

``msgspec`` decodes the body into a small typed struct; ``messages``/``prompt`` are kept as raw JSON
spans (``msgspec.Raw``: no Python strings are built), and everything else is skipped. The body
bytes themselves are forwarded unchanged. The prompt-token estimate is the length of that raw span
divided by 4 (the usual ~4 characters per token for English; JSON punctuation and escapes make
it a slight over-estimate, which only errs on the side of caution for admission).

Types are checked strictly (``"stream": "yes"`` or ``"max_tokens": "10"`` is a 400), as the OpenAI
API does. bench/hotpath.py measures this against ``json`` and ``orjson``.
"""

from __future__ import annotations

import msgspec


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


class Body(msgspec.Struct):
    model: str | None = None
    stream: bool | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    # UNSET when absent, None when null: the splice must know whether the key is there
    priority: int | msgspec.UnsetType | None = msgspec.UNSET
    latency_budget_ms: float | None = None
    task_type: str | None = None
    qos_class: str | None = None
    messages: msgspec.Raw = msgspec.Raw(b"")
    prompt: msgspec.Raw = msgspec.Raw(b"")
    stream_options: StreamOptions | None = None


_decoder = msgspec.json.Decoder(Body)

CHARS_PER_TOKEN = 4


class BadBody(ValueError):
    """A body the gateway cannot read; ``code`` is the metrics reason, the message is for the
    client."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def parse_body(body: bytes) -> Body:
    """The scheduler's fields of an OpenAI request body; ``BadBody`` for malformed JSON/types."""
    try:
        b = _decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise BadBody("invalid_body", f"Invalid request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadBody("invalid_json", f"Malformed JSON body: {exc}") from None
    return b


def estimate_prompt_tokens(b: Body) -> int:
    raw = b.messages if len(b.messages) else b.prompt
    return max(1, len(raw) // CHARS_PER_TOKEN)
