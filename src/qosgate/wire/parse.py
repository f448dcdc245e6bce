"""The hot-path request reader: only the fields the gateway acts on, checked so that what it
decides is what the engine will read.

``msgspec`` decodes the body into a small typed struct; each message's ``content`` and the
completions ``prompt`` are kept as raw JSON spans (``msgspec.Raw``: no Python strings are built),
and every member the gateway does not act on is skipped. The body bytes themselves are forwarded
unchanged (``wire/splice.py`` sets ``priority`` and, when the client sent none, the admitted
``max_tokens``). The prompt-token estimate is the length of the raw messages (or prompt) divided
by 4 (the usual ~4 characters per token for English; JSON punctuation and escapes make it a slight
over-estimate, which only errs on the side of caution for admission). Image and audio parts are
not text: they count what the engine makes of them (``wire/media_cost.py``). They are found
while the messages are checked: a content part is decoded into a struct whose only fields are the
media members, and ``dec_hook`` sees those (a text part costs what its raw span cost; a body of
string contents costs nothing more).

Refused with 400 before anything else happens (``BadBody``; ``code`` is the metrics reason, and
``param`` names the member at fault):

- a body that is not UTF-8 (``invalid_utf8``), not JSON (``invalid_json``), or JSON nested deeper
  than ``MAX_JSON_DEPTH`` (``json_too_deep``: decoders recurse, and a body that one of them could
  read but another, deeper in the stack, could not must never get past the gateway);
- wrong types (``invalid_body``), checked strictly as the OpenAI API does (``"stream": "yes"`` or
  ``"max_tokens": "10"`` is a 400); ``messages`` that is not a non-empty list of objects with a
  string ``role`` (and a string, list or null ``content``); a ``prompt`` that is not a string or a
  non-empty list of strings or token ids;
- a member the gateway acts on (``ACTED``) that appears twice, or whose key is spelled with a
  ``\\u`` escape (``duplicate_key``). JSON parsers differ on duplicates (most take the last, some
  the first) and the priority splice edits the key's bytes: ``{"priority": 3, "pr\\u0069ority":
  -100}`` would otherwise be classified by one member and scheduled by the engine on the other.

Cost: a duplicate of a scalar member is counted while it is decoded (``dec_hook`` on a marker type
per member, a few hundred nanoseconds); the rarer checks (escaped keys, a second ``"messages"``,
nesting: ``wire/json_guards.py``) run a full scan only when a cheap bound says they could be
violated.
bench/hotpath.py measures this against ``json`` and ``orjson``.
"""

from __future__ import annotations

import math
import re
from typing import Any, ClassVar

import msgspec
from msgspec import UNSET, Raw, UnsetType

from qosgate.config import Admission
from qosgate.wire.engine_request import Route
from qosgate.wire.json_guards import BadBody as BadBody  # the parser's refusal too
from qosgate.wire.json_guards import check_depth, check_keys, dup_message, too_deep
from qosgate.wire.media_cost import MediaCost, MediaPart, media_cost

CHARS_PER_TOKEN = 4
# per message, the characters of '{"role":"","content":},' around the raw values (so that a plain
# message costs what its span in the body costs)
_MESSAGE_OVERHEAD = 23


# ---------------------------------------------------------------------- scalar members
class _Member:
    """A scalar member's value, decoded by ``_hook`` (which counts it: a duplicate is seen)."""

    __slots__ = ("v",)
    key: ClassVar[str]

    def __init__(self, v: Any) -> None:
        self.v = v

    @staticmethod
    def check(obj: Any) -> Any:
        raise NotImplementedError


def _typename(obj: Any) -> str:
    if obj is None:
        return "null"
    if isinstance(obj, bool):
        return "bool"
    if isinstance(obj, int):
        return "int"
    if isinstance(obj, float):
        return "float"
    if isinstance(obj, str):
        return "str"
    if isinstance(obj, list):
        return "array"
    return "object"


def _int(obj: Any) -> Any:
    if obj is None or (isinstance(obj, int) and not isinstance(obj, bool)):
        return obj
    raise TypeError(f"Expected `int | null`, got `{_typename(obj)}`")


def _str(obj: Any) -> Any:
    if obj is None or isinstance(obj, str):
        return obj
    raise TypeError(f"Expected `str | null`, got `{_typename(obj)}`")


def _bool(obj: Any) -> Any:
    if obj is None or isinstance(obj, bool):
        return obj
    raise TypeError(f"Expected `bool | null`, got `{_typename(obj)}`")


def _number(obj: Any) -> Any:
    if obj is None:
        return None
    if isinstance(obj, int | float) and not isinstance(obj, bool):
        if not math.isfinite(obj):
            raise ValueError("Expected a finite number")
        return float(obj)
    raise TypeError(f"Expected `number | null`, got `{_typename(obj)}`")


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = None


def _stream_options(obj: Any) -> Any:
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise TypeError(f"Expected `object | null`, got `{_typename(obj)}`")
    if not obj:  # {} asks for nothing: accepted without a stream, as vLLM and OpenAI do
        return None
    usage = obj.get("include_usage")
    if usage is not None and not isinstance(usage, bool):
        raise TypeError(f"include_usage: expected `bool | null`, got `{_typename(usage)}`")
    return StreamOptions(include_usage=usage)


class _Model(_Member):
    __slots__ = ()
    key = "model"
    check = staticmethod(_str)


class _Stream(_Member):
    __slots__ = ()
    key = "stream"
    check = staticmethod(_bool)


class _MaxTokens(_Member):
    __slots__ = ()
    key = "max_tokens"
    check = staticmethod(_int)


class _MaxCompletionTokens(_Member):
    __slots__ = ()
    key = "max_completion_tokens"
    check = staticmethod(_int)


class _MaxOutputTokens(_Member):
    __slots__ = ()
    key = "max_output_tokens"  # the Responses API's output cap
    check = staticmethod(_int)


class _Priority(_Member):
    __slots__ = ()
    key = "priority"
    check = staticmethod(_int)


class _LatencyBudget(_Member):
    __slots__ = ()
    key = "latency_budget_ms"
    check = staticmethod(_number)


class _TaskType(_Member):
    __slots__ = ()
    key = "task_type"
    check = staticmethod(_str)


class _QosClass(_Member):
    __slots__ = ()
    key = "qos_class"
    check = staticmethod(_str)


class _StreamOpts(_Member):
    __slots__ = ()
    key = "stream_options"
    check = staticmethod(_stream_options)


# the keys of the current decode's scalar members, in order (the event loop decodes one body at a
# time: nothing awaits inside a decode)
_seen: list[str] = []


def _hook(tp: type[_Member], obj: Any) -> _Member:
    # only the _Member fields of _Wire are custom types: msgspec calls this for nothing else
    _seen.append(tp.key)
    return tp(tp.check(obj))


# ---------------------------------------------------------------------- the body
class _MediaRef:
    """A content part's image or audio member, seen by ``_media_hook`` while decoding."""

    __slots__ = ()
    kind: ClassVar[str]


class _ImageUrl(_MediaRef):
    __slots__ = ()
    kind = "image_url"


class _InputAudio(_MediaRef):
    __slots__ = ()
    kind = "input_audio"


class _AudioUrl(_MediaRef):
    __slots__ = ()
    kind = "audio_url"


_REFS: dict[type[_MediaRef], _MediaRef] = {t: t() for t in (_ImageUrl, _InputAudio, _AudioUrl)}
_DEFAULT_ADMISSION = Admission()
# the current decode's media members (one decode at a time, as ``_seen``)
_media: list[MediaPart] = []


def _media_hook(tp: type[_MediaRef], obj: Any) -> _MediaRef:
    # only the _MediaRef fields of _Part are custom types: msgspec calls this for nothing else
    _media.append(MediaPart(tp.kind, obj))
    return _REFS[tp]


class _Part(msgspec.Struct, gc=False):
    """A content part as the gateway reads it: its media members, if any (the rest skipped)."""

    image_url: _ImageUrl | UnsetType = UNSET
    input_audio: _InputAudio | UnsetType = UNSET
    audio_url: _AudioUrl | UnsetType = UNSET


class ChatMessage(msgspec.Struct):
    """What the gateway requires of a message: a string ``role``; ``content``, if there, a
    string, a list (of content parts: the engine reads those) or null."""

    role: str
    content: str | list[_Part] | None = None


class _AnyPartsMessage(msgspec.Struct):
    """As ``ChatMessage``, with content parts of any JSON type (the engine judges those)."""

    role: str
    content: str | list[Raw] | None = None


class _Wire(msgspec.Struct):
    model: _Model | UnsetType = UNSET
    stream: _Stream | UnsetType = UNSET
    max_tokens: _MaxTokens | UnsetType = UNSET
    max_completion_tokens: _MaxCompletionTokens | UnsetType = UNSET
    max_output_tokens: _MaxOutputTokens | UnsetType = UNSET
    priority: _Priority | UnsetType = UNSET
    latency_budget_ms: _LatencyBudget | UnsetType = UNSET
    task_type: _TaskType | UnsetType = UNSET
    qos_class: _QosClass | UnsetType = UNSET
    stream_options: _StreamOpts | UnsetType = UNSET
    # raw spans: their length is the prompt estimate; messages are then checked on their own
    messages: Raw = Raw(b"")
    prompt: Raw = Raw(b"")
    input: Raw = Raw(b"")  # the Responses API's prompt (a string or a list of items)
    instructions: Raw = Raw(b"")  # and its system message
    # members a chat template renders into the prompt (``RENDERED``): part of the prompt's
    # identity (``wire.prefix``), kept raw
    tools: Raw = Raw(b"")
    documents: Raw = Raw(b"")
    chat_template: Raw = Raw(b"")
    chat_template_kwargs: Raw = Raw(b"")
    add_generation_prompt: Raw = Raw(b"")
    continue_final_message: Raw = Raw(b"")
    add_special_tokens: Raw = Raw(b"")
    reasoning_effort: Raw = Raw(b"")
    user: Raw = Raw(b"")  # OpenAI's end-user id: a session where configured (kept raw)


# request members a chat template renders into the prompt besides the messages
RENDERED = ("tools", "documents", "chat_template", "chat_template_kwargs",
             "add_generation_prompt", "continue_final_message", "add_special_tokens",
             "reasoning_effort")

_decoder = msgspec.json.Decoder(_Wire, dec_hook=_hook)
_messages = msgspec.json.Decoder(list[ChatMessage], dec_hook=_media_hook)
_any_parts = msgspec.json.Decoder(list[_AnyPartsMessage])
_raw_list = msgspec.json.Decoder(list[Raw])


def _v(m: _Member | UnsetType) -> Any:
    return None if isinstance(m, UnsetType) else m.v


class Body:
    """What the gateway read of a request body."""

    __slots__ = (
        "has_max_completion_tokens", "has_max_output_tokens", "has_max_tokens",
        "latency_budget_ms", "max_completion_tokens", "max_output_tokens", "max_tokens", "media",
        "messages", "model", "priority", "prompt", "prompt_chars", "qos_class", "rendered",
        "stream", "stream_options", "task_type", "user",
    )

    def __init__(
        self, w: _Wire, media: list[MediaPart] | None = None, admission: Admission | None = None
    ) -> None:
        self.model: str | None = _v(w.model)
        self.stream: bool | None = _v(w.stream)
        self.max_tokens: int | None = _v(w.max_tokens)
        self.has_max_tokens = w.max_tokens is not UNSET  # present, possibly null
        self.max_completion_tokens: int | None = _v(w.max_completion_tokens)
        self.has_max_completion_tokens = w.max_completion_tokens is not UNSET
        self.max_output_tokens: int | None = _v(w.max_output_tokens)
        self.has_max_output_tokens = w.max_output_tokens is not UNSET
        # UNSET when absent, None when null: the splice must know whether the key is there
        self.priority: int | UnsetType | None = (
            UNSET if isinstance(w.priority, UnsetType) else w.priority.v
        )
        self.latency_budget_ms: float | None = _v(w.latency_budget_ms)
        self.task_type: str | None = _v(w.task_type)
        self.qos_class: str | None = _v(w.qos_class)
        self.stream_options: StreamOptions | None = _v(w.stream_options)
        self.messages: Raw = w.messages
        self.prompt: Raw = w.prompt
        # (name, raw JSON) of the members a chat template renders, for the prefix keys
        self.rendered: tuple[tuple[str, bytes], ...] = tuple(
            (name, bytes(raw)) for name in RENDERED if len(raw := getattr(w, name)))
        self.user: Raw = w.user
        self.prompt_chars = len(w.messages) or len(w.prompt) or (
            len(w.input) + len(w.instructions))
        # image and audio parts: counted by their own rule, not as characters
        self.media: MediaCost | None = None
        if media:
            adm = admission or _DEFAULT_ADMISSION
            self.media = media_cost(media, adm.images, adm.audio)
            self.prompt_chars -= sum(p.chars for p in media)


def parse_body(body: bytes, route: Route | None = None, admission: Admission | None = None) -> Body:
    """The gateway's members of an OpenAI request body; ``BadBody`` for anything it must refuse
    (see the module doc). ``route`` adds that route's required member (``messages``/``prompt``);
    image and audio parts count by the rules of ``admission`` (the defaults without one)."""
    if not body.isascii():
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadBody(
                "invalid_utf8", f"The request body is not valid UTF-8 (at byte {exc.start})."
            ) from None
    check_depth(body)
    _seen.clear()
    try:
        w = _decoder.decode(body)
    except msgspec.ValidationError as exc:
        msg, param = _validation(str(exc))
        raise BadBody("invalid_body", f"Invalid request body: {msg}", param) from None
    except msgspec.DecodeError as exc:
        raise BadBody("invalid_json", f"Malformed JSON body: {exc}") from None
    except RecursionError:  # pragma: no cover - check_depth stops these first
        raise BadBody("json_too_deep", too_deep(None)) from None
    if len(_seen) != len(set(_seen)):
        dup = next(k for i, k in enumerate(_seen) if k in _seen[:i])
        raise BadBody("duplicate_key", dup_message(dup), dup)
    check_keys(body, route)
    media = None
    if route == "chat" or (route is None and len(w.messages)):
        media = _check_messages(w.messages)
    elif route == "completions":
        _check_prompt(w.prompt)
    elif route == "responses" and not len(w.input):
        raise BadBody("invalid_body", "Invalid request body: `input` is required.", "input")
    return Body(w, media, admission)


def user_of(b: Body) -> str | None:
    """The body's ``user`` member if it is a string (anything else is the engine's to judge)."""
    if not len(b.user) or bytes(memoryview(b.user)[:1]) != b'"':
        return None
    value = msgspec.json.decode(b.user)
    return value if isinstance(value, str) else None


def estimate_prompt_tokens(b: Body) -> int:
    """The prompt's tokens: its text as characters / 4, its image and audio parts as counted
    when the body was read."""
    if b.media is None:
        return max(1, b.prompt_chars // CHARS_PER_TOKEN)
    return max(1, b.prompt_chars // CHARS_PER_TOKEN + b.media.tokens)


def estimate_how(b: Body) -> str:
    """How ``estimate_prompt_tokens`` counted, in words for the client."""
    return "estimated as characters / 4" if b.media is None else b.media.describe()


# ---------------------------------------------------------------------- member checks
def _check_messages(span: Raw) -> list[MediaPart] | None:
    """``messages`` must be a non-empty list of messages (``ChatMessage``), checked natively.
    Returns their image and audio parts. A part that is not an object is left to the engine
    (checked again without parts: the same acceptance and messages as without the media
    reading; such a body's media are not looked for)."""
    if not len(span) or bytes(span) == b"null":
        raise BadBody("invalid_body", "'messages' is required: a non-empty list of messages.",
                      "messages")
    try:
        _media.clear()
        msgs: list[Any] = _messages.decode(span)
        found = list(_media) if _media else None
    except msgspec.ValidationError:
        found = None
        msgs = _lenient_messages(span)
    if not msgs:
        raise BadBody("invalid_body", "'messages' must be a non-empty list.", "messages")
    return found


def _lenient_messages(span: Raw) -> list[Any]:
    try:
        return _any_parts.decode(span)
    except msgspec.ValidationError as exc:
        text = str(exc)
        text = (text.replace("- at `$", "- at `$.messages") if " - at `$" in text
                else text + " - at `$.messages`")
        msg, param = _validation(text)
        raise BadBody("invalid_body", f"Invalid request body: {msg}", param) from None


_PROMPT_MSG = (
    "'prompt' is required: a string, a non-empty list of strings, or token ids "
    "(a list of integers, or a list of such lists)."
)


def _check_prompt(prompt: Raw) -> None:
    head = bytes(memoryview(prompt)[:1])
    if head == b'"':
        return
    if head != b"[":
        raise BadBody("invalid_body", _PROMPT_MSG, "prompt")
    items = _raw_list.decode(prompt)
    if not items:
        raise BadBody("invalid_body", _PROMPT_MSG, "prompt")
    kinds = {_kind(bytes(memoryview(x)[:1])) for x in items}
    if len(kinds) != 1 or None in kinds:
        raise BadBody("invalid_body", _PROMPT_MSG, "prompt")
    if "list" in kinds:
        for x in items:
            inner = _raw_list.decode(x)
            if not inner or any(_kind(bytes(memoryview(y)[:1])) != "int" for y in inner):
                raise BadBody("invalid_body", _PROMPT_MSG, "prompt")


def _kind(head: bytes) -> str | None:
    if head == b'"':
        return "str"
    if head == b"[":
        return "list"
    if head and head in b"-0123456789":
        return "int"
    return None


_AT = re.compile(r" - at `\$\.?(.*)`$")


def _validation(text: str) -> tuple[str, str | None]:
    """msgspec's message and the member it names (``$.messages[0].role`` -> that path)."""
    m = _AT.search(text)
    if m is None:
        return text, None
    return text, m.group(1) or None
