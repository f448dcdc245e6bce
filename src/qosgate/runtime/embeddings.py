"""Answering one client of an embeddings batch, for the engines that serve batches of them."""

from __future__ import annotations

from collections.abc import Sequence

from qosgate.runtime.ports import Call, Withdrawn
from qosgate.wire.embeddings import response
from qosgate.wire.sse import JSON_HEADERS


async def deliver(call: Call, model: str, vectors: Sequence[Sequence[float]],
                  prompt_tokens: int) -> bool:
    """Answer one client of a batch with its own vectors and usage; False if it was withdrawn
    meanwhile (nothing sent)."""
    engine_request = call.engine_request
    body = response(model, vectors, engine_request.encoding_format, prompt_tokens,
                    engine_request.dimensions)
    try:
        await call.sink.start(200, list(JSON_HEADERS))
    except Withdrawn:
        return False
    await call.sink.send(body, False)
    call.done(0, prompt_tokens)
    return True
