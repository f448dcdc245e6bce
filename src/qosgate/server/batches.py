"""The Batch API's HTTP routes: ``/v1/files`` and ``/v1/batches``, as OpenAI's.

A tenant is found from the API key as for completions (the same 401s; open mode: the default
tenant). A file or a job is its tenant's own: another tenant's is a 404, exactly as one that
does not exist. Errors are OpenAI's error objects. What a job's lines do once created is the
feeder's (``runtime/batches/feeder.py``): it is woken by ``on_created`` and ``on_cancel``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import parse_qs

import msgspec

from qosgate.config import QosConfig
from qosgate.core import QosInputError, QosInputs, Scheduler
from qosgate.runtime.batches.records import BatchRecord
from qosgate.runtime.batches.store import BatchStore
from qosgate.runtime.batches.upload import UploadRefused, receive_upload
from qosgate.server.asgi import (
    BODY_TIMEOUT,
    BodyTimeout,
    BodyTooLarge,
    ClientGone,
    Receive,
    Scope,
    Send,
    header,
    not_allowed,
    read_body,
    send_bytes,
    send_json,
)
from qosgate.server.auth import denied_message, input_param, request_key
from qosgate.server.errors import reason_error
from qosgate.server.metrics import GatewayMetrics
from qosgate.settings import GatewaySettings
from qosgate.wire.batches import (
    ENDPOINTS,
    batch_object,
    completion_window_seconds,
    file_object,
    list_object,
)
from qosgate.wire.errors import error_json

log = logging.getLogger("qosgate.batches")

# a file's content goes out in pieces of this size, each read by a worker thread
READ_CHUNK = 256 * 1024
# OpenAI's metadata limits: 16 pairs, keys up to 64 characters, values up to 512
MAX_METADATA = 16
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512
_FILE = re.compile(r"^/v1/files/([^/]+)(/content)?$")
_BATCH = re.compile(r"^/v1/batches/([^/]+)(/cancel)?$")


class _Refusal(Exception):
    """An OpenAI error to answer with."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.body = error_json(message, type_, code, param)


def _not_found(kind: str, object_id: str, param: str = "id") -> _Refusal:
    return _Refusal(404, f"No such {kind} object: {object_id!r}.", param, "not_found")


def _query(scope: Scope) -> dict[str, str]:
    raw: bytes = scope.get("query_string", b"")
    return {k: v[-1] for k, v in parse_qs(raw.decode("latin-1")).items()}


def _limit(q: dict[str, str], default: int = 20, most: int = 100) -> int:
    """A list's ``limit``: OpenAI's defaults are 20 of at most 100 jobs, and 10,000 of at
    most 10,000 files."""
    text = q.get("limit", str(default))
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= most:
        raise _Refusal(400, f"limit must be an integer from 1 to {most}, not {text!r}.",
                       "limit")
    return n


async def _body_chunks(receive: Receive, scope: Scope) -> AsyncIterator[bytes]:
    """A request's body as it arrives; ``ClientGone``/``BodyTimeout`` as ``read_body``."""
    while True:
        msg = await receive()
        if msg["type"] != "http.request":
            raise ClientGone
        chunk: bytes = msg.get("body", b"")
        if chunk:
            yield chunk
        if not msg.get("more_body", False):
            if BODY_TIMEOUT in scope:
                raise BodyTimeout
            return


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    """Read and drop the rest of a refused body: an answer sent while the client is still
    sending would be lost to the connection's reset (nothing of it is kept or written)."""
    with contextlib.suppress(ClientGone, BodyTimeout):
        async for _ in chunks:
            pass


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA or not all(
        isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY
        and len(v) <= MAX_METADATA_VALUE for k, v in value.items()
    ):
        raise _Refusal(400, f"metadata must be an object of at most {MAX_METADATA} string "
                       f"pairs (keys up to {MAX_METADATA_KEY} characters, values up to "
                       f"{MAX_METADATA_VALUE}).", "metadata")
    return value


class BatchRoutes:
    """``handle`` answers the Batch API's routes (False: not one of them)."""

    def __init__(self, cfg: QosConfig, settings: GatewaySettings, store: BatchStore,
                 scheduler: Scheduler, metrics: GatewayMetrics | None = None) -> None:
        self.cfg = cfg
        self.settings = settings
        self.batches = settings.batches
        self.store = store
        self.classifier = scheduler.classifier
        self.metrics = metrics
        self.max_body = settings.server.max_body_bytes
        self._class_names = {c.name.lower(): c.name for c in cfg.classes}
        # set by the feeder: a job was created / asked to stop (wake at once, not at a poll)
        self.on_created: Callable[[str], None] | None = None
        self.on_cancel: Callable[[str], None] | None = None

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> bool:
        path: str = scope["path"]
        if not (path.startswith("/v1/files") or path.startswith("/v1/batches")):
            return False
        method: str = scope["method"]
        try:
            return await self._route(scope, receive, send, path, method)
        except _Refusal as r:
            await send_bytes(send, r.status, r.body)
            return True
        except QosInputError as exc:
            await send_bytes(send, *reason_error(
                exc.code, denied_message(exc, scope),
                input_param(exc, header(scope, b"x-qos-class"))))
            return True
        except (ClientGone, BodyTimeout) as exc:
            if isinstance(exc, BodyTimeout):
                with contextlib.suppress(Exception):
                    await send_bytes(send, 408, error_json(
                        "The request body did not arrive in time.", "timeout_error",
                        "body_timeout"), [(b"content-type", b"application/json"),
                                          (b"connection", b"close")])
            return True
        except Exception:
            log.exception("a batch API request failed in the gateway")
            with contextlib.suppress(Exception):  # the response may have begun
                await send_bytes(send, 500, error_json(
                    "The gateway failed on this request.", "server_error", "internal_error"))
            return True

    async def _route(self, scope: Scope, receive: Receive, send: Send, path: str,
                     method: str) -> bool:
        if path == "/v1/files":
            if method == "POST":
                await self._upload(scope, receive, send)
            elif method == "GET":
                await self._list_files(scope, send)
            else:
                await not_allowed(send, method, path, b"GET, POST")
            return True
        if path == "/v1/batches":
            if method == "POST":
                await self._create(scope, receive, send)
            elif method == "GET":
                await self._list_batches(scope, send)
            else:
                await not_allowed(send, method, path, b"GET, POST")
            return True
        m = _FILE.match(path)
        if m is not None:
            file_id, content = m.group(1), m.group(2)
            if content and method == "GET":
                await self._content(scope, send, file_id)
            elif not content and method == "GET":
                await self._file(scope, send, file_id)
            elif not content and method == "DELETE":
                await self._delete(scope, send, file_id)
            else:
                await not_allowed(send, method, path, b"GET" if content else b"GET, DELETE")
            return True
        m = _BATCH.match(path)
        if m is not None:
            batch_id, cancel = m.group(1), m.group(2)
            if cancel and method == "POST":
                await self._cancel(scope, send, batch_id)
            elif not cancel and method == "GET":
                await self._batch(scope, send, batch_id)
            else:
                await not_allowed(send, method, path, b"POST" if cancel else b"GET")
            return True
        return False

    def _tenant(self, scope: Scope) -> str:
        """The tenant of the request's key (``QosInputError``: a 401)."""
        tenant = self.classifier.tenant_for(request_key(scope))
        return tenant.name if tenant is not None else self.cfg.default_tenant

    # ---------------------------------------------------------------- files
    async def _upload(self, scope: Scope, receive: Receive, send: Send) -> None:
        chunks = _body_chunks(receive, scope)
        try:
            tenant = self._tenant(scope)
        except QosInputError:
            await _drain(chunks)
            raise
        b = self.batches
        staged = self.store.staging_path()
        try:
            up = await receive_upload(chunks, header(scope, b"content-type"), staged,
                                      b.max_file_bytes, b.max_lines)
        except UploadRefused as r:
            await _drain(chunks)
            raise _Refusal(r.status, r.message, r.param, r.code) from r
        rec = await self.store.add_file(tenant, up.purpose, up.filename, up.staged, up.size,
                                        up.lines)
        await send_json(send, 200, file_object(rec))

    async def _list_files(self, scope: Scope, send: Send) -> None:
        tenant = self._tenant(scope)
        q = _query(scope)
        order = q.get("order", "desc")
        if order not in ("asc", "desc"):
            raise _Refusal(400, "order must be 'asc' or 'desc'.", "order")
        page = await self.store.files(tenant, q.get("purpose"), q.get("after"),
                                      _limit(q, 10_000, 10_000), order)
        await send_json(send, 200, list_object([file_object(f) for f in page.items
                                                if not isinstance(f, BatchRecord)],
                                               page.has_more))

    async def _owned_file(self, scope: Scope, file_id: str) -> tuple[str, Any]:
        tenant = self._tenant(scope)
        rec = await self.store.file(file_id, tenant)
        if rec is None:
            raise _not_found("File", file_id)
        return tenant, rec

    async def _file(self, scope: Scope, send: Send, file_id: str) -> None:
        _, rec = await self._owned_file(scope, file_id)
        await send_json(send, 200, file_object(rec))

    async def _delete(self, scope: Scope, send: Send, file_id: str) -> None:
        tenant = self._tenant(scope)
        if not await self.store.delete_file(file_id, tenant):
            raise _not_found("File", file_id)
        await send_json(send, 200, {"id": file_id, "object": "file", "deleted": True})

    async def _content(self, scope: Scope, send: Send, file_id: str) -> None:
        """The file's bytes, streamed from disk (a worker thread reads each piece)."""
        _, rec = await self._owned_file(scope, file_id)
        try:
            f = await asyncio.to_thread(self.store.file_path(file_id).open, "rb")
        except FileNotFoundError:
            raise _not_found("File", file_id) from None
        try:
            size = os.fstat(f.fileno()).st_size
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", b"application/octet-stream"),
                (b"content-length", str(size).encode()),
                (b"content-disposition", f'attachment; filename="{rec.filename}"'.encode()),
            ]})
            while True:
                data = await asyncio.to_thread(f.read, READ_CHUNK)
                if not data:
                    break
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await asyncio.to_thread(f.close)

    # ---------------------------------------------------------------- batches
    async def _json_body(self, scope: Scope, receive: Receive) -> dict[str, Any]:
        try:
            raw = await read_body(receive, self.max_body, scope)
        except BodyTooLarge:
            raise _Refusal(413, f"The request body is over the limit of {self.max_body} "
                           "bytes.", None, "body_too_large") from None
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            raise _Refusal(400, "Malformed JSON body.", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise _Refusal(400, "The body must be a JSON object.", None, "invalid_body")
        return body

    def _job_class(self, scope: Scope, metadata: dict[str, str] | None) -> str:
        """The class a job's lines run at: ``x-qos-class``, else ``metadata.qos_class``, else
        ``batches.default_class``. A class the job names is checked as a request's is (unknown:
        400; outside the tenant's allowed classes: 403); the default is clamped into them. The
        tier's boost does not apply: a line runs at its job's class (``BATCH_LINE``)."""
        raw = header(scope, b"x-qos-class")
        named = (raw.decode("latin-1").strip() if raw is not None else
                 (metadata or {}).get("qos_class") or None)
        name = self.batches.default_class if named is None else named
        name = self._class_names.get(name.lower(), name)
        key = request_key(scope)
        try:
            if named is not None:
                self.classifier.classify(QosInputs(api_key=key, qos_class=name))
            return self.classifier.classify(
                QosInputs(api_key=key, qos_class=name, batch_line=True)).service_class
        except QosInputError as exc:
            if exc.code != "invalid_api_key" and raw is None:
                exc.param = "metadata.qos_class"
            raise

    async def _create(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            tenant = self._tenant(scope)
        except QosInputError:
            with contextlib.suppress(BodyTooLarge, BodyTimeout, ClientGone):
                await read_body(receive, self.max_body, scope)
            raise
        body = await self._json_body(scope, receive)
        for name in ("input_file_id", "endpoint", "completion_window"):
            if not isinstance(body.get(name), str) or not body[name]:
                raise _Refusal(400, f"Missing required parameter: {name!r}.", name,
                               "missing_required_parameter")
        endpoint = body["endpoint"]
        if endpoint not in ENDPOINTS:
            raise _Refusal(400, f"endpoint must be one of {list(ENDPOINTS)}, not "
                           f"{endpoint!r}.", "endpoint", "invalid_value")
        completion_window = body["completion_window"]
        completion_window_s = (completion_window_seconds(completion_window)
                               if completion_window in self.batches.windows else None)
        if completion_window_s is None:
            raise _Refusal(400, f"completion_window must be one of "
                           f"{list(self.batches.windows)}, not {completion_window!r}.",
                           "completion_window", "invalid_value")
        metadata = _metadata(body.get("metadata"))
        qos_class = self._job_class(scope, metadata)
        file_id = body["input_file_id"]
        rec = await self.store.file(file_id, tenant)
        if rec is None:
            raise _not_found("File", file_id, "input_file_id")
        if rec.purpose != "batch":
            raise _Refusal(400, f"The file {file_id!r} has purpose {rec.purpose!r}; a batch's "
                           "input file must have purpose 'batch'.", "input_file_id",
                           "invalid_value")
        job = await self.store.create_batch(tenant, file_id, endpoint, completion_window,
                                            completion_window_s, qos_class, metadata)
        if self.on_created is not None:
            self.on_created(job.id)
        await send_json(send, 200, batch_object(job))

    async def _owned_batch(self, scope: Scope, batch_id: str) -> BatchRecord:
        rec = await self.store.batch(batch_id, self._tenant(scope))
        if rec is None:
            raise _not_found("Batch", batch_id)
        return rec

    async def _batch(self, scope: Scope, send: Send, batch_id: str) -> None:
        await send_json(send, 200, batch_object(await self._owned_batch(scope, batch_id)))

    async def _cancel(self, scope: Scope, send: Send, batch_id: str) -> None:
        rec = await self.store.request_cancel(batch_id, self._tenant(scope))
        if rec is None:
            raise _not_found("Batch", batch_id)
        if rec.status == "cancelling" and self.on_cancel is not None:
            self.on_cancel(batch_id)
        await send_json(send, 200, batch_object(rec))

    async def _list_batches(self, scope: Scope, send: Send) -> None:
        tenant = self._tenant(scope)
        q = _query(scope)
        page = await self.store.batches(tenant, q.get("after"), _limit(q))
        await send_json(send, 200, list_object([batch_object(b) for b in page.items
                                                if isinstance(b, BatchRecord)],
                                               page.has_more))
