"""The step-engine contract: an engine that advances one decode step at a time.

Why a step contract: the scheduler must be able to decide *between* steps which sequences take part
(continuous batching), pause one at a token boundary and resume it later, and the very same engine
model must run in virtual time (simulator) and in real time (gateway). So an engine here is a plain
synchronous object: the driver calls ``step()``; the engine returns what happened in that step and
how long it took (modelled for the simulated engine, measured for llama.cpp).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

from qosgate.core.prefix import Prefix

FinishReason = Literal["stop", "length", "cancelled"]


class BadTextRequest(ValueError):
    """A body the engine cannot serve; ``param`` names the member at fault. Raised while a
    request is read (``wire.textreq``) and by an engine that finds it cannot run a spec."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class Sampling:
    """Sampling parameters as the OpenAI API (and vLLM's extensions) name them.

    The defaults ask for nothing: ``top_k`` 0 and ``min_p`` 0 are off, penalties 0 (1 for
    ``repetition_penalty``) change no logit. ``logit_bias`` is (token id, bias) pairs; ``grammar``
    is a GBNF grammar that every sampled token must keep satisfiable (JSON mode and schemas).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str | None = None


@dataclass(slots=True)
class SeqSpec:
    """One sequence to generate.

    ``prompt_tokens`` is always set (a count); ``prompt``/``messages`` carry text for engines that
    run a real model; ``target_output_tokens`` is the length a simulated engine will generate (drawn
    by a workload or a trace), real engines stop on EOS/stop strings/max_tokens instead.
    ``engine_priority`` follows vLLM polarity: a smaller value runs first. ``max_tokens`` None
    means no cap of the client's own: the sequence may run to the end of the engine's context
    (vLLM's default).
    """

    seq_id: str
    prompt_tokens: int
    max_tokens: int | None
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    target_output_tokens: int | None = None
    sampling: Sampling = field(default_factory=Sampling)
    engine_priority: int = 0
    # the prompt's block keys (``core.prefix``): an engine model with a prefix cache computes
    # only the blocks it does not hold
    prefix: Prefix | None = None
    # the prompt's token ids, for a simulated engine whose tokens follow from them (the vLLM
    # stand-in: ``models/filler.py``); None: it has none
    context_ids: tuple[int, ...] | None = None
    # the model it runs on, for an engine that serves several with different step times (the
    # simulated one: ``SimEngine``'s ``models``); "": the engine's own
    model: str = ""


@dataclass(slots=True)
class TokenEvent:
    """A token produced for ``seq_id`` in this step (``index`` counts from 0 per sequence)."""

    seq_id: str
    index: int
    text: str = ""
    token_id: int = -1


@dataclass(slots=True)
class FinishEvent:
    seq_id: str
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # of the prompt, taken from the engine's prefix cache


@dataclass(slots=True)
class EvictEvent:
    """The engine itself evicted a running sequence (e.g. KV cache full); it stays in the engine's
    waiting queue and resumes by recomputation, emitting no token twice."""

    seq_id: str


@dataclass(slots=True)
class StepResult:
    duration_s: float
    tokens: list[TokenEvent] = field(default_factory=list)
    finished: list[FinishEvent] = field(default_factory=list)
    evicted: list[EvictEvent] = field(default_factory=list)


class StepEngine(Protocol):
    """What the drivers need from an engine that generates in-process (sim model, llama.cpp)."""

    max_num_seqs: int
    # whether its waiting queue runs smallest ``engine_priority`` first (else arrival order)
    ordered: bool

    def add(self, spec: SeqSpec) -> None:
        """Queue a sequence; it joins the batch at the next step boundary."""

    def pause(self, seq_id: str) -> None:
        """Take a sequence out of the batch at the current token boundary, keeping its state."""

    def resume(self, seq_id: str) -> None:
        """Put a paused sequence back; its next token follows the last one emitted."""

    def abort(self, seq_id: str) -> None:
        """Drop a sequence and free its slot and KV state at once."""

    def has_work(self) -> bool:
        """True while any sequence is queued or running (paused ones do not count)."""

    def step(self) -> StepResult:
        """Run one scheduling+forward step and report what it produced."""
