"""The engine-side ``priority``: which value to send, and how to put it into the body cheaply.

Polarity, verified against the engines' sources:

- ``vllm``: a **smaller** value is handled earlier. vLLM ``--scheduling-policy priority``:
  "requests are handled based on given priority (lower value means earlier handling) and time of
  arrival deciding any ties" (vllm/config/scheduler.py; vllm/engine/arg_utils.py). The request
  field: "The priority of the request (lower means earlier handling; default: 0). Any priority
  other than 0 will raise an error if the served model does not use priority scheduling."
  (vllm/entrypoints/openai protocol). That description is stale: vLLM 0.32 under the default
  ``fcfs`` policy accepts a non-zero priority and ignores it (HTTP 200; checked against a real
  vLLM 0.32 by ``tests/e2e/vllm``), older vLLM refused it with 400. Either way a vLLM started with
  ``fcfs`` does nothing with it, so it is given ``none``. NB: one of the seed articles claims a
  *larger* vLLM priority runs first; vLLM's docs and code say the opposite, and this mapping
  follows the code (and a real vLLM 0.32 honours it, ``tests/e2e/vllm``): qosgate's order value
  (``core/queueing/engine_order.py``: band * 2**40 + the rank inside the band) is sent as it is, so
  realtime's band 0 runs before band 3 (offline), and inside a band the request qosgate would
  pick first runs first. vLLM accepts any integer (a Python int; ties go by arrival).
- ``sglang``: a **larger** value runs first by default. SGLang ``--enable-priority-scheduling``;
  the server arg ``schedule_low_priority_values_first`` defaults to False, i.e. larger values are
  scheduled first (sglang/srt/server_args.py). Order value v of n bands is sent as
  ``n * 2**40 - 1 - v``: the same order, turned round.

``priority_order: class`` sends the band alone (vLLM: ``b``; SGLang: ``n - 1 - b``) for anything
that reads the value as a small class number.
- ``none``: the member is removed, so a client's QoS ``priority`` never reaches an engine that
  would refuse it, ignore it, or read it the other way round.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from qosgate.core.queueing.engine_order import band_of, top

Polarity = Literal["vllm", "sglang", "none"]
PriorityOrder = Literal["full", "class"]

_encode = msgspec.json.Encoder().encode


def engine_priority(polarity: Polarity, order: int, levels: int,
                    detail: PriorityOrder = "full") -> int | None:
    """The engine-side priority for qosgate's order value ``order`` (``core.queueing.engine_order``;
    smaller first) with ``levels`` bands."""
    if polarity == "none":
        return None
    if detail == "class":
        band = band_of(order)
        return band if polarity == "vllm" else levels - 1 - band
    return order if polarity == "vllm" else top(levels) - 1 - order


# a member's value as the splice replaces it in place: an integer, as vLLM/SGLang take it, or null
_VALUE = rb"\s*:\s*(?:-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|null)"
_LEAD_WS = re.compile(rb"\s*\{(\s*\})?")
# an escape of an ASCII letter or '_': a key could be spelled so
_ESCAPED_NAME_CHAR = re.compile(rb"\\u00[4-7][0-9a-fA-F]")
_members: dict[str, tuple[bytes, re.Pattern[bytes]]] = {}
_top_decoder = msgspec.json.Decoder(dict[str, msgspec.Raw])


def _member(key: str) -> tuple[bytes, re.Pattern[bytes]]:
    m = _members.get(key)
    if m is None:
        quoted = b'"' + key.encode() + b'"'
        m = _members[key] = (quoted, re.compile(re.escape(quoted) + _VALUE))
    return m


def set_member(body: bytes, key: str, value: int | bytes | None, present: bool) -> bytes:
    """``body`` with its top-level member ``key`` set to ``value`` (an integer, or raw JSON
    bytes; removed when None), every other byte unchanged.

    ``present`` says whether the body has a top-level ``key`` (the decoder knows). Absent: the
    member is inserted right after the opening brace (one copy of the body). Present: if the bytes
    ``"key"`` occur exactly once, and no key in the body could be spelled with an escape, they are
    that member's key, and its value is replaced in place (a couple of ``bytes.find`` scans at C
    speed); otherwise (the word also appears nested, e.g. in a tool's JSON schema, or as a string,
    or twice) the top level is re-encoded: every member the engine will read once, ours last-set,
    the nested values' bytes unchanged -- the rare slow path. (The gateway refuses duplicated or
    escaped keys it acts on before this; the slow path keeps the splice exact on its own.)
    """
    quoted, pattern = _member(key)
    if not present:
        if value is None:
            return body
        m = _LEAD_WS.match(body)
        if m is None:
            raise ValueError("The request body must be a JSON object.")
        end = m.start(1) if m.group(1) else m.end()
        sep = b"" if m.group(1) else b","
        return body[:end] + quoted + b":" + _raw(value) + sep + body[end:]
    i = body.find(quoted)
    if (
        i >= 0
        and body.find(quoted, i + len(quoted)) < 0  # the key's bytes occur once: it is it
        and not (b"\\u00" in body and _ESCAPED_NAME_CHAR.search(body))
    ):
        m = pattern.match(body, i)
        if m is not None:
            if value is not None:
                return body[:i] + quoted + b":" + _raw(value) + body[m.end() :]
            return _remove_member(body, i, m.end())
    obj = _top_decoder.decode(body)  # duplicates collapse: the last one, as engines read them
    if value is None:
        obj.pop(key, None)
    else:
        obj[key] = msgspec.Raw(_raw(value))
    return _encode(obj)


def _raw(value: int | bytes) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def set_priority(body: bytes, value: int | None, present: bool) -> bytes:
    """``body`` with its top-level ``priority`` set to ``value`` (removed when None): see
    ``set_member``."""
    return set_member(body, "priority", value, present)


def _remove_member(body: bytes, start: int, end: int) -> bytes:
    """Remove the member at [start, end) and one adjacent comma."""
    j = end
    n = len(body)
    while j < n and body[j] in b" \t\r\n":
        j += 1
    if j < n and body[j : j + 1] == b",":
        return body[:start] + body[j + 1 :]
    i = start - 1
    while i >= 0 and body[i] in b" \t\r\n":
        i -= 1
    if i >= 0 and body[i : i + 1] == b",":
        return body[:i] + body[end:]
    return body[:start] + body[end:]
