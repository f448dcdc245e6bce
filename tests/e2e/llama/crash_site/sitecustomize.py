"""A test double on ``PYTHONPATH``: llama.cpp's decode calls ``os.abort()`` in one process of a
``qosgate serve`` tree, to show what a native crash of the embedded engine does to the gateway.

Every process of the tree imports it (the gateway and its start-up check's child);
``QOSGATE_TEST_ABORT_IN`` says which one crashes: ``preflight`` -- the check's child
(``python -m qosgate.runtime.preflight``); ``gateway`` -- the gateway itself, whose check then
passes. Unset, it does nothing. The decode is wrapped when ``llama_cpp`` is imported, so nothing
loads llama.cpp earlier than the gateway would.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any

WHERE = os.environ.get("QOSGATE_TEST_ABORT_IN")


def _in_check() -> bool:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    return spec is not None and spec.name == "qosgate.runtime.preflight"


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        module: ModuleType | None = self.inner.create_module(spec)
        return module

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        decode = module.llama_decode

        def llama_decode(ctx: Any, batch: Any) -> Any:
            if _in_check() == (WHERE == "preflight"):
                os.abort()
            return decode(ctx, batch)

        module.llama_decode = llama_decode  # type: ignore[attr-defined]


class _Finder(importlib.abc.MetaPathFinder):
    busy = False

    def find_spec(self, name: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != "llama_cpp" or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.busy = False
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if WHERE in ("preflight", "gateway"):
    sys.meta_path.insert(0, _Finder())
