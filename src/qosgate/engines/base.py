"""The engine side of the gateway: what the asyncio driver needs from a replica.

A replica runs *engine calls*. The driver starts one (``Engine.run``) when the core dispatches a
request there, cancels the task to pull it back before its first token or when the client leaves,
and, on an engine that can (in-process), pauses and resumes it at a token boundary. The call
reports back through ``Call``: first token (the driver asks the core whether it may still be
forwarded), done with the token counts, or failed. Response bytes go straight to ``call.sink``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

Route = Literal["chat", "completions"]


@dataclass(slots=True)
class Job:
    """What an engine needs to serve one request: the client's own body and what was read of it."""

    rid: str
    route: Route
    body: bytes
    stream: bool
    model: str
    max_tokens: int  # effective: the client's, or the gateway default when it sent none
    prompt_tokens: int  # estimate (chars/4)
    include_usage: bool = False
    has_priority: bool = False  # the body has a top-level "priority" member


class Sink(Protocol):
    started: bool
    complete: bool

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None: ...

    async def send(self, data: bytes, more: bool = True) -> None: ...


class Call(Protocol):
    job: Job
    sink: Sink

    def level(self) -> int:
        """The request's queue band now (0 = most urgent), for the engine-side priority."""
        ...

    def levels(self) -> int:
        """How many bands there are."""
        ...

    def first_token(self) -> bool:
        """A first token since (re)dispatch; False if the request may not be forwarded."""
        ...

    def done(self, output_tokens: int, prompt_tokens: int | None = None) -> None: ...

    def failed(self, reason: str, output_tokens: int = 0) -> None: ...


@dataclass(slots=True, frozen=True)
class Unservable:
    """A body an engine cannot serve: answered 400, ``param`` naming the member at fault."""

    message: str
    param: str | None = None


class Engine(Protocol):
    name: str
    capacity: int
    pausable: bool

    @property
    def ready(self) -> bool: ...

    def models(self) -> list[str]: ...

    def check_body(self, body: bytes, route: Route) -> Unservable | None:
        """Why this engine could not serve ``body`` (None if it can): asked before admission,
        so a request that can never run is refused with 400 instead of queueing first."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def run(self, call: Call) -> None:
        """Serve ``call`` to its end; cancellation aborts it in the engine at once."""
        ...

    def pause(self, rid: str) -> None: ...

    def resume(self, rid: str) -> None: ...
