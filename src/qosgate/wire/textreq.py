"""What an engine that runs a real model needs from an OpenAI body: the text and the sampling.

The hot-path parser (``wire/parse.py``) reads only what the scheduler needs and keeps
``messages``/``prompt`` as raw JSON spans. An in-process model (llama.cpp) needs the text itself,
so the engine call decodes the body once more, here, into a typed ``msgspec`` struct: messages
(role and text content), prompt (a string or a list of one string), the output cap and the
sampling. What each member does here -- honoured, refused or ignored -- is listed once, in
``textparams.py``: a member that asks for something this engine cannot do is refused with a 400
naming it rather than silently ignored.

Values are checked the way vLLM checks them, with its messages (``temperature`` in [0, 2],
``top_p`` in (0, 1], ``top_k`` 0/-1 or >= 1, ``min_p`` in [0, 1], presence and frequency penalties
in [-2, 2], ``repetition_penalty`` > 0, at most 4 ``stop`` strings, ``n`` = 1 only,
``stream_options`` only with ``stream``, ``response_format.type`` one of ``text``,
``json_object``, ``json_schema``, a schema that converts to a grammar); a bad one is a
``BadTextRequest`` that the engine answers with a 400 in OpenAI's error format. What needs the
model itself (the prompt's length against the context, token ids in ``logit_bias``) is checked by
the engine (``LlamaCppEngine.check``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, cast

import msgspec

from qosgate.models.step import BadTextRequest, Sampling
from qosgate.wire.engine_request import Route
from qosgate.wire.jsongrammar import ANY_OBJECT, BadSchema, schema_grammar, schema_text
from qosgate.wire.textparams import NOTHING, REFUSED

MAX_STOP = 4
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when the body sets none
MAX_BIAS = 100.0  # logit_bias values are clamped to [-100, 100] (OpenAI's range, vLLM clamps)
RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class JsonSchemaFormat(msgspec.Struct):
    name: str | None = None
    description: str | None = None
    schema: Any = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: str
    json_schema: JsonSchemaFormat | None = None


class TextBody(msgspec.Struct):
    """The members honoured (typed); the refused ones are added from ``textparams.REFUSED``."""

    messages: list[Message] | None = None
    prompt: str | list[str | int] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: msgspec.Raw = msgspec.Raw(b"")
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None


# refused members are kept raw: only whether they ask for something matters
_Body = cast(
    "type[TextBody]",
    msgspec.defstruct(
        "TextBodyWithRefused",
        [(p.name, msgspec.Raw, msgspec.Raw(b"")) for p in REFUSED],
        bases=(TextBody,),
    ),
)
_decoder = msgspec.json.Decoder(_Body)


@dataclass(slots=True)
class TextRequest:
    messages: list[dict[str, str]] | None
    prompt: str | None
    sampling: Sampling
    max_tokens: int | None = None  # None: the client set no cap
    max_tokens_param: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"


def _content(msg: Message, i: int) -> str:
    c = msg.content
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    texts: list[str] = []
    for part in c:
        if part.type != "text" or part.text is None:
            raise BadTextRequest(
                f"messages[{i}]: content parts of type {part.type!r} are not supported by this "
                "model; send text.",
                "messages",
            )
        texts.append(part.text)
    return "".join(texts)


def parse_text_request(body: bytes, route: Route) -> TextRequest:
    """The text, output cap and sampling of an OpenAI chat/completions body (see the module)."""
    try:
        b = _decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BadTextRequest(f"Invalid request body: {exc}", _param(str(exc))) from None
    except RecursionError:
        raise BadTextRequest("The JSON body is nested too deeply.") from None
    for refused in REFUSED:
        if not refused.asks_nothing(bytes(getattr(b, refused.name))):
            raise BadTextRequest(
                f"'{refused.name}' is not supported by this engine ({refused.note}); "
                "leave it out.",
                refused.name,
            )
    if b.n is not None and b.n != 1:
        raise BadTextRequest("Only n=1 is supported.", "n")
    if not b.stream and b"".join(bytes(b.stream_options).split()) not in NOTHING | {b"{}"}:
        raise BadTextRequest(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    max_tokens, cap_param = _cap(b)
    sampling = _sampling(b)
    if route == "chat":
        if not b.messages:
            raise BadTextRequest("'messages' must be a non-empty list.", "messages")
        msgs = [{"role": m.role, "content": _content(m, i)} for i, m in enumerate(b.messages)]
        return TextRequest(msgs, None, sampling, max_tokens, cap_param)
    p = b.prompt
    if isinstance(p, list):
        if len(p) != 1 or not isinstance(p[0], str):
            raise BadTextRequest(
                "'prompt' must be a string or a list of exactly one string.", "prompt"
            )
        p = p[0]
    if not p:
        raise BadTextRequest("'prompt' must be a non-empty string.", "prompt")
    return TextRequest(None, p, sampling, max_tokens, cap_param)


def _cap(b: TextBody) -> tuple[int | None, Literal["max_tokens", "max_completion_tokens"]]:
    """The client's output cap: max_completion_tokens (OpenAI's newer name) wins."""
    if b.max_completion_tokens is not None:
        if b.max_completion_tokens < 1:
            raise BadTextRequest(
                f"max_completion_tokens must be at least 1, got {b.max_completion_tokens}.",
                "max_completion_tokens",
            )
        return b.max_completion_tokens, "max_completion_tokens"
    if b.max_tokens is not None and b.max_tokens < 1:
        raise BadTextRequest(f"max_tokens must be at least 1, got {b.max_tokens}.", "max_tokens")
    return b.max_tokens, "max_tokens"


def _sampling(b: TextBody) -> Sampling:
    temperature = DEFAULT_TEMPERATURE if b.temperature is None else b.temperature
    if not 0.0 <= temperature <= 2.0:
        raise BadTextRequest(
            f"temperature must be between 0 and 2, got {temperature:g}.", "temperature"
        )
    top_p = 1.0 if b.top_p is None else b.top_p
    if not 0.0 < top_p <= 1.0:
        raise BadTextRequest(f"top_p must be in (0, 1], got {top_p:g}.", "top_p")
    top_k = 0 if b.top_k is None or b.top_k == -1 else b.top_k  # vLLM: -1 is "off" too
    if top_k < 0:
        raise BadTextRequest(f"top_k must be 0 (disable), or at least 1, got {top_k}.", "top_k")
    min_p = 0.0 if b.min_p is None else b.min_p
    if not 0.0 <= min_p <= 1.0:
        raise BadTextRequest(f"min_p must be in [0, 1], got {min_p}.", "min_p")
    presence = 0.0 if b.presence_penalty is None else b.presence_penalty
    if not -2.0 <= presence <= 2.0:
        raise BadTextRequest(
            f"presence_penalty must be in [-2, 2], got {presence}.", "presence_penalty"
        )
    frequency = 0.0 if b.frequency_penalty is None else b.frequency_penalty
    if not -2.0 <= frequency <= 2.0:
        raise BadTextRequest(
            f"frequency_penalty must be in [-2, 2], got {frequency}.", "frequency_penalty"
        )
    repetition = 1.0 if b.repetition_penalty is None else b.repetition_penalty
    if not 0.0 < repetition < float("inf"):
        raise BadTextRequest(
            f"repetition_penalty must be greater than zero, got {repetition}.",
            "repetition_penalty",
        )
    if b.stop is None:
        stop: tuple[str, ...] = ()
    elif isinstance(b.stop, str):
        stop = (b.stop,)
    else:
        if len(b.stop) > MAX_STOP:
            raise BadTextRequest(f"At most {MAX_STOP} stop sequences are allowed.", "stop")
        stop = tuple(b.stop)
    return Sampling(
        temperature=temperature, top_p=top_p, seed=b.seed, stop=stop, top_k=top_k,
        min_p=min_p, presence_penalty=presence, frequency_penalty=frequency,
        repetition_penalty=repetition, logit_bias=_logit_bias(b.logit_bias),
        grammar=_grammar(b.response_format),
    )


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """Token id -> bias, clamped to [-100, 100] as vLLM does (ids are checked by the engine)."""
    if not bias:
        return ()
    out: list[tuple[int, float]] = []
    bad: list[str] = []
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            bad.append(key)
            continue
        out.append((token, min(MAX_BIAS, max(-MAX_BIAS, value))))
    if bad:
        raise BadTextRequest(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}",
            "logit_bias",
        )
    return tuple(out)


def _grammar(rf: ResponseFormat | None) -> str | None:
    """The GBNF grammar ``response_format`` asks for (None for plain text)."""
    if rf is None or rf.type == "text":
        return None
    if rf.type not in RESPONSE_FORMATS:
        allowed = ", ".join(f"'{t}'" for t in RESPONSE_FORMATS)
        raise BadTextRequest(
            f"Invalid value for response_format.type: {rf.type!r}. Supported values are: "
            f"{allowed}.",
            "response_format",
        )
    if rf.type == "json_object":
        schema = ANY_OBJECT
    else:
        if rf.json_schema is None:
            raise BadTextRequest(
                "response_format of type 'json_schema' needs a 'json_schema' object.",
                "response_format",
            )
        given = rf.json_schema.schema
        if given is None:  # a name without a schema: any JSON object
            schema = ANY_OBJECT
        elif not isinstance(given, dict):
            raise BadTextRequest(
                "response_format.json_schema.schema must be a JSON object (a JSON Schema).",
                "response_format",
            )
        else:
            schema = schema_text(given)
    try:
        return schema_grammar(schema)
    except BadSchema as exc:
        raise BadTextRequest(
            f"response_format.json_schema.schema is not a JSON Schema this engine can enforce: "
            f"{exc}",
            "response_format",
        ) from None


def _param(text: str) -> str | None:
    """The member a msgspec error names (``... - at `$.messages[0].content```)."""
    i = text.rfind(" - at `$")
    if i < 0:
        return None
    return text[i + 8 :].rstrip("`").lstrip(".") or None


_enc = msgspec.json.Encoder().encode


