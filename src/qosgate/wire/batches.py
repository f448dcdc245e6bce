"""The Batch API on the wire (pure): one input line read and checked, the OpenAI objects a file
and a job are shown as, and the lines of a job's output and error files.

What is checked where follows OpenAI. The upload (``POST /v1/files``) checks only the file as a
whole (a ``.jsonl`` name, its size and line count); a malformed line is accepted there. The
lines are read when the job is validated: a bad line fails the whole job (``failed``, with
``errors.data[]`` naming the line, 1-based) before anything runs. The codes are OpenAI's:
``invalid_json_line``, ``duplicate_custom_id``, ``url_mismatch``, ``model_mismatch`` (one job,
one model), ``model_not_found``, ``empty_file``, ``too_many_tasks``; a line that is JSON but not
a request (a member missing or of the wrong type, a method other than POST) is
``invalid_request`` with ``param`` naming the member. What only the engine can judge (a bad
``messages``, a prompt too long) is not checked here: that line runs and its error response goes
to the job's error file, as OpenAI does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import xxhash

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# a group key covers this much of a line's prompt: lines that share it share a prompt prefix
# long enough (~128 tokens) for an engine's prefix cache to be worth sending them together
GROUP_PREFIX_BYTES = 512
# OpenAI limits custom_id to 64 characters
MAX_CUSTOM_ID = 64


@dataclass(frozen=True, slots=True)
class Line:
    """A line that is a request: its id, its body as the file gave it, the model it asks for,
    and its prompt-prefix key (``group_key``)."""

    custom_id: str
    body: bytes
    model: str
    group: int


@dataclass(frozen=True, slots=True)
class LineProblem:
    """Why a line is not a request: an entry of OpenAI's ``errors.data[]`` (without the line)."""

    code: str
    message: str
    param: str | None = None


class _Request(msgspec.Struct):
    custom_id: Any = None
    method: Any = None
    url: Any = None
    body: msgspec.Raw = msgspec.Raw(b"")


class _Body(msgspec.Struct):
    model: Any = None
    stream: Any = None
    messages: msgspec.Raw = msgspec.Raw(b"")
    prompt: msgspec.Raw = msgspec.Raw(b"")
    input: msgspec.Raw = msgspec.Raw(b"")


_request_decoder = msgspec.json.Decoder(_Request)
_body_decoder = msgspec.json.Decoder(_Body)


def _invalid(message: str, param: str) -> LineProblem:
    return LineProblem("invalid_request", message, param)


def parse_line(raw: bytes, endpoint: str) -> Line | LineProblem:
    """One line of an input file (without its newline), for a job on ``endpoint``."""
    try:
        req = _request_decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        # not JSON, or JSON that is not an object
        return LineProblem("invalid_json_line", "This line is not parseable as valid JSON.")
    cid = req.custom_id
    if not isinstance(cid, str) or not cid:
        return _invalid("custom_id must be a non-empty string.", "custom_id")
    if len(cid) > MAX_CUSTOM_ID:
        return _invalid(f"custom_id is at most {MAX_CUSTOM_ID} characters.", "custom_id")
    if req.method != "POST":
        return _invalid("The method of every request in a batch must be POST.", "method")
    if not isinstance(req.url, str):
        return _invalid("url must be a string.", "url")
    if req.url != endpoint:
        return LineProblem(
            "url_mismatch",
            f"The url of this request ({req.url!r}) does not match the batch's endpoint "
            f"({endpoint!r}).", "url")
    body = bytes(req.body)
    try:
        b = _body_decoder.decode(body) if body else None
    except (msgspec.DecodeError, msgspec.ValidationError):
        b = None
    if b is None:
        return _invalid("body must be a JSON object (the request's body).", "body")
    if not isinstance(b.model, str) or not b.model:
        return _invalid("body.model must be a non-empty string.", "body.model")
    if b.stream is not None and b.stream is not False:
        # a line's answer is one JSON response in the output file, never an event stream
        return _invalid("Streaming is not supported in a batch: remove body.stream or set it "
                        "to false.", "body.stream")
    prompt = bytes(b.messages) or bytes(b.prompt) or bytes(b.input)
    return Line(cid, body, b.model, group_key(b.model, prompt))


def group_key(model: str, prompt: bytes) -> int:
    """A cheap key of a prompt's head: the first ``GROUP_PREFIX_BYTES`` of its raw JSON with the
    model (XXH3). Lines with the same key begin alike; a prompt shorter than that shares a key
    only with the same prompt. Raw bytes, not the canonical form of ``wire/prefix.py``: this is
    a hint for the order lines go out in, not the router's prefix identity."""
    return int(xxhash.xxh3_64_intdigest(prompt[:GROUP_PREFIX_BYTES], seed=len(model))
               ^ xxhash.xxh3_64_intdigest(model.encode())) >> 1  # fits SQLite's signed 64 bits


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}


def completion_window_seconds(completion_window: str) -> float | None:
    """A ``completion_window`` (a number and s, m, h or d: ``24h``) in seconds; None if it is
    not one."""
    unit = _UNITS.get(completion_window[-1:])
    try:
        n = float(completion_window[:-1])
    except ValueError:
        return None
    if unit is None or not n > 0 or n == float("inf"):
        return None
    return n * unit


def duplicate_problem(custom_id: str) -> LineProblem:
    return LineProblem(
        "duplicate_custom_id",
        f"The custom_id {custom_id!r} is a duplicate of another request's in this batch; "
        "custom_id must be unique within a batch.", "custom_id")


def model_problems(model: str, first_model: str, served: bool) -> LineProblem | None:
    """A line's model against the job's (its first line's) and what is served."""
    if model != first_model:
        return LineProblem(
            "model_mismatch",
            f"The model {model!r} differs from the batch's ({first_model!r}); all requests in "
            "a batch must use the same model.", "body.model")
    if not served:
        return LineProblem("model_not_found",
                           f"The model {model!r} is not served by this gateway.", "body.model")
    return None


def empty_problem() -> LineProblem:
    return LineProblem("empty_file", "The batch input file is empty (it has no requests).")


def too_many_problem(limit: int) -> LineProblem:
    return LineProblem("too_many_tasks",
                       f"The batch input file has more than {limit} requests.")


# ---------------------------------------------------------------------- output lines
_encode = msgspec.json.Encoder().encode


def request_id_of(batch_id: str, line: int) -> str:
    """The ``batch_req_...`` id of a job's line: derived, so a file written again after a
    crash is the same file."""
    digest = hashlib.blake2b(f"{batch_id}:{line}".encode(), digest_size=12).hexdigest()
    return "batch_req_" + digest


def _json_or_text(body: bytes) -> Any:
    """An engine's answer as JSON if it is JSON (spliced untouched), else as a string."""
    try:
        return msgspec.json.decode(body, type=msgspec.Raw)
    except msgspec.DecodeError:
        return body.decode("utf-8", "replace")


def output_line(batch_id: str, line: int, custom_id: str, status_code: int | None,
                request_id: str | None, body: bytes | None, error_code: str | None,
                error_message: str | None) -> bytes:
    """One line of a job's output or error file, newline included: ``response`` when the
    engine answered (any status), else ``error`` with why there is no answer."""
    if status_code is not None:
        response: Any = {"status_code": status_code, "request_id": request_id or "",
                         "body": _json_or_text(body or b"")}
        error: Any = None
    else:
        response = None
        error = {"code": error_code or "batch_error", "message": error_message or ""}
    return _encode({"id": request_id_of(batch_id, line), "custom_id": custom_id,
                    "response": response, "error": error}) + b"\n"


# ---------------------------------------------------------------------- objects
# what is shown of the runtime's records (``runtime/batches/records.py``), which the wire layer
# may not import: any object with these attributes


class FileView(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def bytes(self) -> int: ...
    @property
    def created_at(self) -> int: ...
    @property
    def filename(self) -> str: ...
    @property
    def purpose(self) -> str: ...


class ErrorView(Protocol):
    @property
    def code(self) -> str: ...
    @property
    def message(self) -> str: ...
    @property
    def param(self) -> str | None: ...
    @property
    def line(self) -> int | None: ...


class BatchView(Protocol):
    @property
    def id(self) -> str: ...
    @property
    def endpoint(self) -> str: ...
    @property
    def input_file_id(self) -> str: ...
    @property
    def completion_window(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def created_at(self) -> int: ...
    @property
    def expires_at(self) -> int: ...
    @property
    def total(self) -> int: ...
    @property
    def completed(self) -> int: ...
    @property
    def failed(self) -> int: ...
    @property
    def in_progress_at(self) -> int | None: ...
    @property
    def finalizing_at(self) -> int | None: ...
    @property
    def completed_at(self) -> int | None: ...
    @property
    def failed_at(self) -> int | None: ...
    @property
    def expired_at(self) -> int | None: ...
    @property
    def cancelling_at(self) -> int | None: ...
    @property
    def cancelled_at(self) -> int | None: ...
    @property
    def output_file_id(self) -> str | None: ...
    @property
    def error_file_id(self) -> str | None: ...
    @property
    def metadata(self) -> dict[str, str] | None: ...
    @property
    def errors(self) -> Sequence[ErrorView]: ...
    @property
    def model(self) -> str | None: ...

def file_object(f: FileView) -> dict[str, Any]:
    """A file as OpenAI shows it (``openai/types/file_object.py``)."""
    return {"id": f.id, "object": "file", "bytes": f.bytes, "created_at": f.created_at,
            "filename": f.filename, "purpose": f.purpose, "status": "processed",
            "expires_at": None, "status_details": None}


def batch_object(b: BatchView) -> dict[str, Any]:
    """A job as OpenAI shows it (``openai/types/batch.py``)."""
    errors = None
    if b.errors:
        errors = {"object": "list", "data": [
            {"code": e.code, "message": e.message, "param": e.param, "line": e.line}
            for e in b.errors]}
    return {
        "id": b.id, "object": "batch", "endpoint": b.endpoint, "errors": errors,
        "input_file_id": b.input_file_id, "completion_window": b.completion_window,
        "status": b.status, "output_file_id": b.output_file_id,
        "error_file_id": b.error_file_id, "created_at": b.created_at,
        "in_progress_at": b.in_progress_at, "expires_at": b.expires_at,
        "finalizing_at": b.finalizing_at, "completed_at": b.completed_at,
        "failed_at": b.failed_at, "expired_at": b.expired_at,
        "cancelling_at": b.cancelling_at, "cancelled_at": b.cancelled_at,
        "request_counts": {"total": b.total, "completed": b.completed, "failed": b.failed},
        "metadata": b.metadata, "model": b.model,
    }


def list_object(data: Sequence[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A list page as OpenAI's cursor pages: ``first_id``/``last_id`` for ``after``."""
    return {"object": "list", "data": list(data),
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}
