"""The engine-side ``priority``: which value to send, and how to put it into the body cheaply.

Polarity, verified against the engines' sources:

- ``vllm``: a **smaller** value is handled earlier. vLLM ``--scheduling-policy priority``:
  "requests are handled based on given priority (lower value means earlier handling) and time of
  arrival deciding any ties" (vllm/config/scheduler.py; vllm/engine/arg_utils.py). The request
  field: "The priority of the request (lower means earlier handling; default: 0). Any priority
  other than 0 will raise an error if the served model does not use priority scheduling."
  (vllm/entrypoints/openai protocol). That description is stale: vLLM 0.32 under the default
  ``fcfs`` policy accepts a non-zero priority and ignores it (HTTP 200; checked against a real
  vLLM 0.32 by ``tests/vllm``), older vLLM refused it with 400. Either way a vLLM started with
  ``fcfs`` does nothing with it, so it is given ``none``. NB: one of the seed articles claims a
  *larger* vLLM priority runs first; vLLM's docs and code say the opposite, and this mapping
  follows the code (and a real vLLM 0.32 honours it, ``tests/vllm``): band 0 (realtime) is sent
  as priority 0, band 3 (offline) as 3.
- ``sglang``: a **larger** value runs first by default. SGLang ``--enable-priority-scheduling``;
  the server arg ``schedule_low_priority_values_first`` defaults to False, i.e. larger values are
  scheduled first (sglang/srt/server_args.py). Band b of n is sent as ``n - 1 - b``.
- ``none``: the member is removed, so a client's QoS ``priority`` never reaches an engine that
  would refuse it, ignore it, or read it the other way round.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

Polarity = Literal["vllm", "sglang", "none"]

_full_decoder = msgspec.json.Decoder()
_encode = msgspec.json.Encoder().encode


def engine_priority(polarity: Polarity, level: int, levels: int) -> int | None:
    """The engine-side priority for queue band ``level`` (0 = most urgent) of ``levels``."""
    if polarity == "vllm":
        return level
    if polarity == "sglang":
        return levels - 1 - level
    return None


# a top-level "priority" member: key, value (an integer, as vLLM/SGLang take it, or null)
_PRIO = re.compile(rb'"priority"\s*:\s*(?:-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|null)')
_LEAD_WS = re.compile(rb"\s*\{(\s*\})?")
_KEY = b'"priority"'


def set_priority(body: bytes, value: int | None, present: bool) -> bytes:
    """``body`` with its top-level ``priority`` set to ``value`` (removed when None), every other
    byte unchanged.

    ``present`` says whether the body has a top-level ``priority`` (the decoder knows). Absent: the
    member is inserted right after the opening brace (one copy of the body). Present: if the bytes
    ``"priority"`` occur exactly once they are that member's key, and its value is replaced in
    place (two ``bytes.find`` scans at C speed); otherwise (the word also appears nested, e.g. in
    a tool's JSON schema, or as a string) the body is re-encoded whole, the rare slow path.
    """
    if not present:
        if value is None:
            return body
        m = _LEAD_WS.match(body)
        if m is None:
            raise ValueError("The request body must be a JSON object.")
        end = m.start(1) if m.group(1) else m.end()
        sep = b"" if m.group(1) else b","
        return body[:end] + b'"priority":' + str(value).encode() + sep + body[end:]
    i = body.find(_KEY)
    if i >= 0 and body.find(_KEY, i + len(_KEY)) < 0:  # the key's bytes occur once: it is it
        m = _PRIO.match(body, i)
        if m is not None:
            if value is not None:
                return body[:i] + b'"priority":' + str(value).encode() + body[m.end() :]
            return _remove_member(body, i, m.end())
    obj = _full_decoder.decode(body)
    if value is None:
        obj.pop("priority", None)
    else:
        obj["priority"] = value
    return _encode(obj)


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
