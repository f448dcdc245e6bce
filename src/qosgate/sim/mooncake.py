"""The Mooncake trace format: one JSON object a line, ``timestamp`` (ms from the start),
``input_length``, ``output_length`` (tokens) and ``hash_ids`` (the prompt's 512-token KV blocks,
as integers; two requests sharing a leading run of ids share that prefix of prompt).

Why a module of its own: the Azure CSV has no prefix identity, this one does, and the checks that
make a bad line an error naming its line (not a traceback mid-run) are particular to it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from qosgate.core.prefix import Prefix

BLOCK_TOKENS = 512  # the trace's block size (Mooncake's KV block)
FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
# (seconds from the start, prompt tokens, output tokens, prompt blocks)
MooncakeRow = tuple[float, int, int, Prefix]


def looks_like_jsonl(path: Path) -> bool:
    """A ``.jsonl`` file, or one whose first non-blank character opens a JSON object."""
    if path.suffix == ".jsonl":
        return True
    with path.open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                return line.lstrip().startswith("{")
    return False


def _count(rec: dict[str, object], key: str, where: str) -> int:
    v = rec[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"{where}: {key} must be a whole number >= 0, got {v!r}")
    return v


def parse_lines(lines: Iterable[str], source: str) -> list[MooncakeRow]:
    """Every non-blank line as a row, in file order; a bad line is a ``ValueError`` naming
    ``source``, the line number and what is wrong with it. A zero length is kept as 1 (as the
    Azure reader does)."""
    rows: list[MooncakeRow] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}: line {n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not JSON ({exc.msg})") from None
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a JSON object with {', '.join(FIELDS)}")
        missing = [k for k in FIELDS if k not in rec]
        if missing:
            raise ValueError(f"{where}: missing {', '.join(missing)}")
        stamp = rec["timestamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, int | float) or stamp < 0:
            raise ValueError(f"{where}: timestamp must be milliseconds >= 0, got {stamp!r}")
        ids = rec["hash_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(k, int) and not isinstance(k, bool) for k in ids
        ):
            raise ValueError(f"{where}: hash_ids must be a list of integers")
        prompt = max(1, _count(rec, "input_length", where))
        output = max(1, _count(rec, "output_length", where))
        rows.append((stamp / 1000.0, prompt, output, Prefix(tuple(ids), BLOCK_TOKENS)))
    return rows
