"""Two JSON answers of an engine compared as vLLM's own: member order included, floats to 1e-4
(the engine's arithmetic is not bit-reproducible from one batch to the next)."""

from __future__ import annotations

import math
from typing import Any


def same_json(got: Any, want: Any, path: str = "$") -> None:
    """Equal, member order included; floats equal to 1e-4 (see the module docstring)."""
    if isinstance(want, dict):
        assert isinstance(got, dict), path
        assert list(got) == list(want), f"{path}: members {list(got)} != {list(want)}"
        for k in want:
            same_json(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            same_json(g, w, f"{path}[{i}]")
    elif isinstance(want, float):
        assert isinstance(got, float) and math.isclose(got, want, rel_tol=1e-4, abs_tol=1e-4), (
            f"{path}: {got} != {want}")
    else:
        assert type(got) is type(want) and got == want, f"{path}: {got!r} != {want!r}"
