"""The models the gateway serves, as its engines list them (``/v1/models``), and each model's
context length: the request flow asks for it on every request, so it is read from the engines'
entries at most once a second (they change only when a probe reads them again). A configured
LoRA adapter (``models[].base``) is served wherever its base is, listed by the engine or not."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Set
from typing import Any

from qosgate.runtime.ports import Engine
from qosgate.wire.answers import context_of, merge_cards


class Catalog:
    """The engines' models: ids in first-served order, merged cards, context lengths."""

    def __init__(self, engines: dict[str, Engine], clock: Callable[[], float],
                 adapters: Mapping[str, Set[str]] | None = None) -> None:
        """``adapters``: each base model's configured adapters."""
        self.engines = engines
        self.clock = clock
        self.adapters = adapters or {}
        self._contexts: dict[str, int | None] = {}
        self._contexts_until = -math.inf

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for e in self.engines.values():
            for m in e.models():
                seen.setdefault(m, None)
                for adapter in sorted(self.adapters.get(m, ())):
                    seen.setdefault(adapter, None)
        return list(seen)

    def model_cards(self) -> list[dict[str, Any]]:
        """``/v1/models``: the engines' own entries, each model once (``merge_cards``)."""
        return merge_cards([e.model_cards() for e in self.engines.values()])

    def context(self, model: str) -> int | None:
        """The context length of ``model`` as its engines report it (the smallest)."""
        now = self.clock()
        if now >= self._contexts_until:
            self._contexts = {c["id"]: context_of(c) for c in self.model_cards()}
            self._contexts_until = now + 1.0
        return self._contexts.get(model)
