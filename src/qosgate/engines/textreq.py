"""What an engine that runs a real model needs from an OpenAI body: the text and the sampling.

The hot-path parser (``server/parse.py``) reads only what the scheduler needs and keeps
``messages``/``prompt`` as raw JSON spans. An in-process model (llama.cpp) needs the text itself,
so the engine call decodes the body once more, here, into a typed ``msgspec`` struct: messages
(role and text content), prompt (a string or a list of one string), ``temperature``, ``top_p``,
``seed``, ``stop`` and ``n``. Unknown members are ignored, as OpenAI-compatible servers do --
except those asking for what this engine cannot do, which are refused rather than silently
ignored: ``tools``/``functions`` (no tool calling), ``logprobs``/``top_logprobs``.

Values are checked the way the OpenAI API checks them (``temperature`` in [0, 2], ``top_p`` in
(0, 1], at most 4 ``stop`` strings, ``n`` = 1 only); a bad one is a ``BadTextRequest`` that the
engine call answers with a 400 in OpenAI's error format.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from qosgate.engines.base import Route
from qosgate.engines.step import Sampling

MAX_STOP = 4
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when the body sets none


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None


class TextBody(msgspec.Struct):
    messages: list[Message] | None = None
    prompt: str | list[str | int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    # asked for, but not something this engine does: refused (kept raw: only presence matters)
    tools: msgspec.Raw = msgspec.Raw(b"")
    functions: msgspec.Raw = msgspec.Raw(b"")
    logprobs: msgspec.Raw = msgspec.Raw(b"")
    top_logprobs: msgspec.Raw = msgspec.Raw(b"")


# JSON values that ask for nothing: absent, null, false, 0, an empty list
_NOTHING = frozenset((b"", b"null", b"false", b"0", b"[]"))


_decoder = msgspec.json.Decoder(TextBody)


class BadTextRequest(ValueError):
    """A body the engine cannot serve; ``param`` names the member at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class TextRequest:
    messages: list[dict[str, str]] | None
    prompt: str | None
    sampling: Sampling


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
    """The text and sampling of an OpenAI chat/completions body (see the module doc)."""
    try:
        b = _decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise BadTextRequest(f"Invalid request body: {exc}", _param(str(exc))) from None
    except RecursionError:
        raise BadTextRequest("The JSON body is nested too deeply.") from None
    for name, raw, what in (
        ("tools", b.tools, "tool calling"),
        ("functions", b.functions, "function calling"),
        ("logprobs", b.logprobs, "log probabilities"),
        ("top_logprobs", b.top_logprobs, "log probabilities"),
    ):
        if bytes(raw).replace(b" ", b"") not in _NOTHING:
            raise BadTextRequest(
                f"'{name}' is not supported by this engine (no {what}); leave it out.", name
            )
    if b.n is not None and b.n != 1:
        raise BadTextRequest("Only n=1 is supported.", "n")
    temperature = DEFAULT_TEMPERATURE if b.temperature is None else b.temperature
    if not 0.0 <= temperature <= 2.0:
        raise BadTextRequest(
            f"temperature must be between 0 and 2, got {temperature:g}.", "temperature"
        )
    top_p = 1.0 if b.top_p is None else b.top_p
    if not 0.0 < top_p <= 1.0:
        raise BadTextRequest(f"top_p must be in (0, 1], got {top_p:g}.", "top_p")
    if b.stop is None:
        stop: tuple[str, ...] = ()
    elif isinstance(b.stop, str):
        stop = (b.stop,)
    else:
        if len(b.stop) > MAX_STOP:
            raise BadTextRequest(f"At most {MAX_STOP} stop sequences are allowed.", "stop")
        stop = tuple(b.stop)
    sampling = Sampling(temperature=temperature, top_p=top_p, seed=b.seed, stop=stop)
    if route == "chat":
        if not b.messages:
            raise BadTextRequest("'messages' must be a non-empty list.", "messages")
        msgs = [{"role": m.role, "content": _content(m, i)} for i, m in enumerate(b.messages)]
        return TextRequest(msgs, None, sampling)
    p = b.prompt
    if isinstance(p, list):
        if len(p) != 1 or not isinstance(p[0], str):
            raise BadTextRequest(
                "'prompt' must be a string or a list of exactly one string.", "prompt"
            )
        p = p[0]
    if not p:
        raise BadTextRequest("'prompt' must be a non-empty string.", "prompt")
    return TextRequest(None, p, sampling)


def _param(text: str) -> str | None:
    """The member a msgspec error names (``... - at `$.messages[0].content```)."""
    i = text.rfind(" - at `$")
    if i < 0:
        return None
    return text[i + 8 :].rstrip("`").lstrip(".") or None


_enc = msgspec.json.Encoder().encode


def error_body(message: str, param: str | None = None, code: str = "invalid_request") -> bytes:
    """OpenAI's error object (engines sit below ``server/``, so they cannot use its helper)."""
    return _enc(
        {"error": {"message": message, "type": "invalid_request_error", "param": param,
                   "code": code}}
    )
