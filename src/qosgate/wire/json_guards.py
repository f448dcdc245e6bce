"""What a JSON body must be, beyond what a decoder checks, before the gateway acts on it: nested no
deeper than ``MAX_JSON_DEPTH``, and each member the gateway acts on (``ACTED``) present once,
its key spelled without escapes (see ``wire/parse.py`` for why). ``BadBody`` is the refusal of a
body, here and in the parser.
"""

from __future__ import annotations

import re
from array import array
from itertools import accumulate

import msgspec

from qosgate.wire.engine_request import Route

MAX_JSON_DEPTH = 256


class BadBody(ValueError):
    """A body the gateway cannot read; ``code`` is the metrics reason, the message is for the
    client, ``param`` the member at fault (OpenAI's ``param``)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param


# every top-level member the gateway reads or rewrites
ACTED = frozenset(
    ("model", "stream", "max_tokens", "max_completion_tokens", "max_output_tokens", "priority",
     "latency_budget_ms", "task_type", "qos_class", "stream_options", "messages", "prompt",
     "input")
)


def dup_message(key: str) -> str:
    return (
        f"The member `{key}` appears more than once in the body, or with an escaped key: the "
        "gateway acts on it, so it must appear once, its key spelled without escapes."
    )



# ---------------------------------------------------------------------- nesting
_OPEN = bytes(c for c in range(256) if c not in b"[{")
_STRUCTURE = bytes(c for c in range(256) if c not in b'"[]{}')
_STEP = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")


def json_depth(body: bytes) -> int:
    """How deeply ``body``'s JSON nests (brackets inside strings excluded), in a few passes at C
    speed: drop escaped backslashes and escaped quotes, keep only quotes and brackets, drop what
    lies between quotes, then the running sum of +1/-1 per bracket."""
    s = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _STRUCTURE)
    brackets = b"".join(s.split(b'"')[::2]).translate(_STEP)
    return max(accumulate(array("b", brackets)), default=0)


def check_depth(body: bytes) -> None:
    """``BadBody`` if ``body`` nests deeper than ``MAX_JSON_DEPTH``. Free for a body too short
    to nest that deep, one pass for one with fewer opening brackets than that."""
    if len(body) <= 2 * MAX_JSON_DEPTH:
        return
    if len(body.translate(None, _OPEN)) <= MAX_JSON_DEPTH:
        return
    depth = json_depth(body)
    if depth > MAX_JSON_DEPTH:
        raise BadBody("json_too_deep", too_deep(depth))


def too_deep(depth: int | None) -> str:
    got = f"{depth} levels" if depth is not None else "too deeply"
    return f"The JSON body is nested {got}; the limit is {MAX_JSON_DEPTH} levels."


# ---------------------------------------------------------------------- keys
# an escape of an ASCII letter or '_': how a key the gateway acts on could be spelled escaped
_ESCAPED_NAME_CHAR = re.compile(rb"\\u00[4-7][0-9a-fA-F]")
_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')
_COLON = re.compile(rb"\s*:")


def top_level_keys(body: bytes) -> list[bytes]:
    """The raw (undecoded) keys of the top-level object, in order, duplicates included."""
    keys: list[bytes] = []
    depth = 0
    for m in _TOKEN.finditer(body):
        tok = m.group()
        c = tok[:1]
        if c in b"[{":
            depth += 1
        elif c in b"]}":
            depth -= 1
        elif depth == 1 and _COLON.match(body, m.end()):
            keys.append(tok)
    return keys


# the member holding a route's prompt: the large one, whose duplicate decoding does not catch
_PROMPT_KEYS: dict[Route | None, bytes] = {"completions": b'"prompt"', "responses": b'"input"'}


def check_keys(body: bytes, route: Route | None) -> None:
    """``BadBody`` if a key the gateway acts on is escaped, or the prompt's member
    (``messages``/``prompt``/``input``) appears twice at the top level (a scalar's duplicate is
    caught while decoding). Scans the keys only when a cheap test says it could be so."""
    suspect = b"\\u00" in body and _ESCAPED_NAME_CHAR.search(body) is not None
    if not suspect:
        big = _PROMPT_KEYS.get(route, b'"messages"')
        first = body.find(big)
        suspect = first >= 0 and body.find(big, first + len(big)) >= 0
        if not suspect and route is None:
            first = body.find(b'"prompt"')
            suspect = first >= 0 and body.find(b'"prompt"', first + 8) >= 0
    if not suspect:
        return
    seen: set[str] = set()
    for raw in top_level_keys(body):
        try:
            key = msgspec.json.decode(raw, type=str)
        except msgspec.DecodeError:  # pragma: no cover - the body decoded: its keys do too
            continue
        if key not in ACTED:
            continue
        if key in seen or b"\\" in raw:
            raise BadBody("duplicate_key", dup_message(key), key)
        seen.add(key)
