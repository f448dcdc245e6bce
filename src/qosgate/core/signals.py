"""What an engine says about its own load: the facts ``Scheduler.observe`` takes.

The runtime fills one from a scrape of an upstream's ``/metrics`` (vLLM, SGLang, llama.cpp
server), the simulator and the in-process engines from their own state. Every field is optional:
an engine that does not export a figure leaves it None, and a controller that needs it does
nothing with that sample. ``at`` is the driver's clock when the figures were read, so that stale
data can be told from fresh.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadSignals:
    at: float
    running: int | None = None  # sequences the engine is running now
    waiting: int | None = None  # sequences waiting inside the engine (its own queue)
    kv_usage: float | None = None  # KV cache in use, a fraction 0..1
    preemptions_total: int | None = None  # engine-side preemptions since it started (a counter)
    # its inter-token latency histogram's totals (vLLM's vllm:inter_token_latency_seconds _sum
    # and _count): between two scrapes, their deltas are the mean time per output token the
    # engine's streams got over that interval, seconds after the fact rather than at the end
    # of each request
    itl_seconds_total: float | None = None
    itl_tokens_total: int | None = None
    # the tokens it has taken in and put out since it started (counters): its progress, which
    # stands still on an engine that holds work and is hung (``core/progress.py``)
    prompt_tokens_total: int | None = None
    output_tokens_total: int | None = None
    # an engine serving several models that accounts its time per model: per model, (engine
    # seconds, prompt tokens, output tokens) since it started; the scheduler learns the
    # models' weights from their deltas (``core.weights``)
    model_time: tuple[tuple[str, float, int, int], ...] | None = None
    # the LoRA adapters it holds loaded, most recently used first, and how many it can hold
    # (vLLM's ``--max-loras``): a request for one of them pays no load there
    adapters: tuple[str, ...] | None = None
    adapter_capacity: int | None = None

    @property
    def tokens_total(self) -> int | None:
        """Prompt and output tokens together (None where the engine exports neither)."""
        if self.prompt_tokens_total is None and self.output_tokens_total is None:
            return None
        return (self.prompt_tokens_total or 0) + (self.output_tokens_total or 0)

    def share(self, inflight: int) -> float:
        """The part of what the engine holds (running + waiting) that ``inflight`` requests of
        one gateway are: 1 alone, less when other gateways feed the same engine (1 when the
        engine reports holding nothing)."""
        held = (self.running or 0) + (self.waiting or 0)
        return min(1.0, inflight / held) if held else 1.0
