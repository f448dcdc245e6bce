"""The project's scripts as modules: ``scripts/`` and ``deploy/`` are not packages, but their
tests call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_module(path: str) -> ModuleType:
    """The file at ``path`` (relative to the checkout) as a module named after it, registered
    in ``sys.modules`` (dataclasses look their module up by name)."""
    name = Path(path).stem
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
