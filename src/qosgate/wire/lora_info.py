"""vLLM's ``vllm:lora_requests_info`` read into the adapters an engine holds, most recent first.

Pure: text in, names out. vLLM 0.32 sets one series of this gauge per engine step, labelled with
the adapters that had requests running or waiting (``running_lora_adapters``,
``waiting_lora_adapters``, comma-separated) and ``max_lora`` (its ``--max-loras``), and its value
is the wall time of that step. A label set is never removed, so one scrape holds a series for
every combination seen since the engine started, each stamped with when it was last true.

vLLM keeps up to ``max_lora`` adapters loaded and evicts the least recently used, so walking the
series from the newest stamp back and collecting adapter names until there are ``max_lora`` of
them gives the adapters it holds now, in the order it would evict them last to first. An engine
started with ``--lora-modules`` has them loaded before any request, but no series names them until
one runs: the gateway cannot tell those apart from unloaded ones, and treats them as cold.
"""

from __future__ import annotations

import math
from typing import NamedTuple

NAME = "vllm:lora_requests_info"


class Adapters(NamedTuple):
    """The adapters an engine holds, most recently used first, and how many it can hold."""

    loaded: tuple[str, ...]
    capacity: int


def labels(block: str) -> dict[str, str]:
    """``a="x",b="y"`` (the text between a sample's braces) -> {"a": "x", "b": "y"}."""
    out: dict[str, str] = {}
    i, n = 0, len(block)
    while i < n:
        eq = block.find("=", i)
        if eq == -1:
            break
        key = block[i:eq].strip().lstrip(",").strip()
        j = block.find('"', eq)
        if j == -1:
            break
        j += 1
        value: list[str] = []
        while j < n and block[j] != '"':
            if block[j] == "\\" and j + 1 < n:
                j += 1
                value.append({"n": "\n"}.get(block[j], block[j]))
            else:
                value.append(block[j])
            j += 1
        out[key] = "".join(value)
        i = j + 1
    return out


def _series(text: str) -> list[tuple[float, dict[str, str]]]:
    out: list[tuple[float, dict[str, str]]] = []
    for raw in text.split("\n"):
        line = raw.strip(" \t\r")
        if not line.startswith(NAME + "{"):
            continue
        end = line.rfind("}")
        if end == -1:
            continue
        parts = line[end + 1 :].split()
        try:
            stamp = float(parts[0]) if parts else math.nan
        except ValueError:
            continue
        if math.isfinite(stamp):
            out.append((stamp, labels(line[len(NAME) + 1 : end])))
    return out


def loaded_adapters(text: str) -> Adapters | None:
    """The adapters the engine behind ``text`` holds; None where it exports no series (LoRA off,
    or not one engine step yet)."""
    series = _series(text)
    if not series:
        return None
    series.sort(key=lambda s: s[0], reverse=True)
    try:
        capacity = max(1, int(series[0][1].get("max_lora", "1")))
    except ValueError:
        capacity = 1
    loaded: list[str] = []
    for _, lab in series:
        for key in ("running_lora_adapters", "waiting_lora_adapters"):
            for name in lab.get(key, "").split(","):
                if name and name not in loaded:
                    loaded.append(name)
        if len(loaded) >= capacity:
            break
    return Adapters(tuple(loaded[:capacity]), capacity)
