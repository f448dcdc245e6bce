"""The utility routes an engine serves beside generation (``/tokenize``, ``/detokenize``,
``/version``, ``/ping``, ``/load``: ``server/routes.py``), passed through to one ready replica.

They take no slot and wait in no queue: they are not generation, and a tokenizer call held behind
a flood would be no answer. But they are the gateway's all the same: authenticated where the
table says so, named to the engine by a request id (``X-Request-Id``), and counted
(``qosgate_passthrough_requests_total{route, status}``). A body's ``model`` picks the replicas
serving it; the engine's answer goes back as it was, status and bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import msgspec

from qosgate.core import QosInputError
from qosgate.runtime.ports import Engine
from qosgate.server.asgi import (
    BodyTimeout,
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    read_body,
    send_bytes,
)
from qosgate.server.auth import denied_message, request_key
from qosgate.server.errors import reason_error
from qosgate.server.routes import PASSED
from qosgate.wire.errors import error_json
from qosgate.wire.sse import JSON_HEADERS, Headers

# the routes that need no key: what load balancers and health checkers call
_KEYLESS = frozenset(("/version", "/ping"))
_models_of = msgspec.json.Decoder(dict[str, object])


class Forwarding(Protocol):
    """An engine that passes a utility call through (``OpenAIUpstream.forward``)."""

    async def forward(self, method: str, path: str, body: bytes, rid: str
                      ) -> tuple[int, bytes | None, bytes] | None: ...


class PassThrough:
    """``/tokenize`` and the like, to a ready replica that serves the body's model."""

    def __init__(self, engines: Mapping[str, Engine], authorize: Callable[[str | None], None],
                 new_id: Callable[[], str], count: Callable[[str, int], None],
                 max_body: int) -> None:
        self.engines = engines
        self.authorize = authorize  # raises QosInputError for a key the gateway refuses
        self.new_id = new_id
        self.count = count
        self.max_body = max_body

    async def handle(self, scope: Scope, receive: Receive, send: Send, path: str,
                     method: str) -> None:
        route = PASSED[path]
        assert method in route.methods
        if path not in _KEYLESS:
            try:
                self.authorize(request_key(scope))
            except QosInputError as exc:
                await self._answer(send, path, 401, error_json(
                    denied_message(exc, scope), "invalid_request_error", exc.code))
                return
        body = b""
        if method == "POST":
            try:
                body = await read_body(receive, self.max_body, scope)
            except ClientGone:
                return
            except (BodyTooLarge, BodyTimeout) as exc:
                reason = "body_too_large" if isinstance(exc, BodyTooLarge) else "body_timeout"
                status, err = reason_error(reason)
                await self._answer(send, path, status, err)
                return
        model = _model_of(body)
        engine = self._replica(model)
        if isinstance(engine, tuple):
            await self._answer(send, path, *engine)
            return
        rid = self.new_id()
        got = await engine.forward(method, path, body, rid)
        if got is None:
            status, err = reason_error("upstream_unreachable")
            await self._answer(send, path, status, err, rid)
            return
        status, ctype, data = got
        await self._answer(send, path, status, data, rid,
                           [] if ctype is None else [(b"content-type", ctype)])

    def _replica(self, model: str | None) -> Forwarding | tuple[int, bytes]:
        """The first ready replica that passes calls through and serves ``model``; else the
        refusal: no such model, none that passes calls through, or none ready now."""
        remote = [e for e in self.engines.values() if hasattr(e, "forward")]
        if not remote:
            return 404, error_json(
                "This route is passed through to upstream engines; the built-in engine does "
                "not serve it.", "invalid_request_error", "not_found")
        serving = [e for e in remote if model is None or model in e.models()]
        if not serving:
            return 404, error_json(f"The model `{model}` does not exist.",
                                   "invalid_request_error", "model_not_found")
        for e in serving:
            if e.ready:
                forwarding: Forwarding = e  # type: ignore[assignment]
                return forwarding
        return reason_error("no_replica_available")

    async def _answer(self, send: Send, path: str, status: int, body: bytes,
                      rid: str | None = None, headers: Headers | None = None) -> None:
        """The answer: qosgate's own (JSON), or the engine's with its own content type."""
        self.count(path, status)
        headers = list(JSON_HEADERS) if headers is None else headers
        if rid is not None:
            headers = [*headers, (b"x-qosgate-request-id", rid.encode())]
        if status == 503:
            headers = [*headers, (b"retry-after", b"1")]
        await send_bytes(send, status, body, headers)


def _model_of(body: bytes) -> str | None:
    """The body's ``model``, if it is a JSON object naming one (anything else: any replica; the
    engine judges the body)."""
    if not body:
        return None
    try:
        model = _models_of.decode(body).get("model")
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    return model if isinstance(model, str) else None

