"""The engine side of the gateway: what the asyncio driver needs from a replica.

A replica runs *engine calls*. The driver starts one (``Engine.run``) when the core dispatches a
request there, cancels the task to pull it back before its first byte or when the client leaves,
and, on an engine that can (in-process), pauses and resumes it at a token boundary. Response bytes
go straight to ``call.sink``; its ``start`` is where the first byte leaves, and the driver's sink
raises the core's ``first_byte`` fact there (raising ``Withdrawn`` if the request may no longer be
delivered: the call then stops quietly). The call reports facts back through ``Call``: tokens
streamed so far, done with the token counts, an attempt that failed before the first byte (the
core may retry it elsewhere), a failure or a timeout after it.

The driver, not the engine, owns the health cadence: it awaits ``Engine.probe()`` on an interval
and hands what it found to the core.
"""

from __future__ import annotations

from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, Protocol

from qosgate.core.facts import AttemptFailed
from qosgate.core.signals import LoadSignals
from qosgate.wire.engine_request import EngineRequest, Route, Unservable
from qosgate.wire.resume import Transcript


class Withdrawn(Exception):
    """Raised by the driver's ``Sink.start`` when the request may no longer reach its client
    (pulled back or ended meanwhile): the engine call stops and sends nothing."""


@dataclass(frozen=True, slots=True)
class Health:
    """What one probe of a replica found."""

    up: bool
    models: tuple[str, ...] | None = None  # None: unchanged / not known
    signals: LoadSignals | None = None


class SendFn(Protocol):
    def __call__(self, data: bytes, more: bool = True) -> Coroutine[Any, Any, None]: ...


class Sink(Protocol):
    @property
    def started(self) -> bool: ...

    @property
    def complete(self) -> bool: ...

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    @property
    def send(self) -> SendFn:
        """Write body bytes (``more=False``: the last part); a method or a bound one."""
        ...


class Call(Protocol):
    engine_request: EngineRequest
    # what a stream delivered so far, for an answer that can continue on another engine call
    # (``wire/resume.py``); None for the others
    transcript: Transcript | None

    @property
    def sink(self) -> Sink: ...

    def order(self) -> int:
        """qosgate's order for the engine's own waiting queue (``core.queueing.engine_order``: band,
        then rank in it; smaller first), for the engine-side priority."""
        ...

    def levels(self) -> int:
        """How many bands there are."""
        ...

    def level(self) -> int:
        """The request's class level (0 the most urgent)."""
        ...

    def progress(self, tokens: int) -> None:
        """``tokens`` output tokens have been sent to the client so far."""
        ...

    def output_cap(self) -> int:
        """The most output tokens the engine may produce for it (the client's cap, a
        configured ceiling, or the rest of the model's context)."""
        ...

    def token_s(self) -> float | None:
        """The engine's recent time per output token on the replica this call went to, as its
        ``/metrics`` said (None: not measured yet)."""
        ...

    def first_token(self) -> None:
        """The engine's first token is in, for a client that gets its answer whole at the end:
        the request's TTFT is this moment, once that answer is delivered (``sink.start`` is
        still where the core learns of the first byte: until then the request may be retried
        or pulled back, as nothing reached its client)."""
        ...

    def done(self, output_tokens: int, prompt_tokens: int | None = None,
             cached_tokens: int | None = None) -> None:
        """The call completed: its output tokens and, where the engine said, its prompt tokens
        and how many of them it took from its prefix cache."""
        ...

    def failed(self, reason: str, output_tokens: int = 0) -> None:
        """The call failed after its first byte (or for good): the request ends ``failed``."""
        ...

    def attempt_failed(self, fact: AttemptFailed) -> None:
        """The call failed before anything reached the client: the core may retry it on
        another replica (``AttemptFailed`` says how it failed)."""
        ...

    def timed_out(self, reason: str) -> None:
        """A bound ran out after the first byte (idle between chunks, total time)."""
        ...

    def moved(self, fact: AttemptFailed) -> None:
        """The call failed after the first byte (``fact`` says how) while its ``transcript``
        can continue: the core may continue it on another replica, or end it."""
        ...

    def unresumable(self) -> None:
        """The answer turned out not to continue exactly (its ``transcript`` says why)."""
        ...

    def continued(self, prompt_tokens: int, cached_tokens: int | None) -> None:
        """A continuation sent ``prompt_tokens`` again; the engine had ``cached_tokens`` of
        them (None: not said yet)."""
        ...

    def refused(self, status: int, body: bytes) -> None:
        """The engine refused the request itself (a 4xx) before anything reached the client:
        the request ends ``rejected`` and the client gets ``body`` (OpenAI's error format)."""
        ...


class Engine(Protocol):
    name: str
    max_window: int
    pausable: bool
    # it continues a stream from token ids (``Call.transcript``): a stream evicted from it, or
    # off it when it fails, goes on on another call
    resumes: bool
    # whether it runs its waiting queue in the order sent (``Call.order``): an engine-side
    # priority it honours
    ordered: bool
    # a server reached over the network (an upstream), where a call sent may wait in the
    # server's own queue unseen; not a model in this process, where a call sent is computed
    remote: bool

    @property
    def ready(self) -> bool: ...

    def models(self) -> list[str]: ...

    def model_cards(self) -> list[dict[str, Any]]:
        """The ``/v1/models`` entries as the engine reports them (vLLM's carry
        ``max_model_len``), passed through to clients and read for the context bound."""
        ...

    def check_body(self, body: bytes, route: Route) -> Unservable | None:
        """Why this engine could not serve ``body`` (None if it can): asked before admission,
        so a request that can never run is refused with 400 instead of queueing first."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def probe(self) -> Health:
        """Check the replica once (its models, its load); never raises."""
        ...

    async def run(self, call: Call) -> None:
        """Serve ``call`` to its end; cancellation aborts it in the engine at once."""
        ...

    def pause(self, rid: str) -> None: ...

    def resume(self, rid: str) -> None: ...
