"""What an engine is asked to serve, as read from the wire: the route, the engine request (the
client's own body and what the gateway read of it), and why a body cannot be served.

An engine request is one engine call: what the driver hands a replica for one client request.
A Batch API job (``qosgate.runtime.batches``) is something else: a file of many requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Route = Literal["chat", "completions", "responses", "embeddings"]


@dataclass(slots=True)
class EngineRequest:
    """What an engine needs to serve one request: the client's own body and what was read of it."""

    rid: str
    route: Route
    body: bytes
    stream: bool
    model: str
    # the output cap as the engine will read it: the client's (max_completion_tokens first), a
    # configured ceiling the gateway inserted, or None: the engine's own default (vLLM's: the
    # rest of the context)
    max_tokens: int | None
    prompt_tokens: int  # estimate (chars/4)
    include_usage: bool = False
    has_priority: bool = False  # the body has a top-level "priority" member
    first_byte_timeout_s: float = 60.0  # the engine's silence after dispatch that fails an attempt
    # embeddings: the inputs (strings, or token arrays), as parsed; how the client wants vectors
    inputs: list[str] | list[list[int]] | None = None
    encoding_format: str = "float"
    dimensions: int | None = None
    user: str | None = None


@dataclass(slots=True, frozen=True)
class Unservable:
    """A body an engine cannot serve: answered 400, ``param`` naming the member at fault."""

    message: str
    param: str | None = None
