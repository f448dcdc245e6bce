"""The frozen values the batch store hands out: files, jobs, lines to run and their results.

Shared by the store (which writes them), the HTTP routes (which render them in OpenAI's shapes)
and the feeder (which runs lines and records results). Times are wall-clock Unix seconds, as the
OpenAI objects carry them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling",
    "cancelled",
]
# every status, in the order a job passes through them (metrics list them all)
BATCH_STATUSES: tuple[str, ...] = (
    "validating", "in_progress", "finalizing", "cancelling", "completed", "failed", "expired",
    "cancelled",
)
# a job in one of these has ended: nothing more runs or is written for it
TERMINAL: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str  # "file-..."
    tenant: str
    purpose: str  # "batch" (uploads), "batch_output" (results written by qosgate)
    filename: str
    bytes: int
    created_at: int
    lines: int


@dataclass(frozen=True, slots=True)
class BatchError:
    """One problem of a job as a whole (OpenAI's ``errors.data[]``): validation of its file."""

    code: str
    message: str
    param: str | None = None
    line: int | None = None  # 1-based, as OpenAI counts a file's lines


@dataclass(frozen=True, slots=True)
class BatchRecord:
    id: str  # "batch_..."
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: BatchStatus
    qos_class: str  # the class its lines ask for (the tenant's allowed classes may clamp it)
    created_at: int
    expires_at: int  # the window's end: the job's deadline
    total: int = 0
    completed: int = 0
    failed: int = 0
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    metadata: dict[str, str] | None = None
    errors: tuple[BatchError, ...] = ()
    fence: int = 0  # the fencing token of its current owner (runtime/batches/lease.py)
    model: str | None = None  # the model its lines ask for (known once validated)


@dataclass(frozen=True, slots=True)
class LineTask:
    """A line to run: its request as the file gave it."""

    batch_id: str
    line: int  # 0-based index in the input file
    custom_id: str
    url: str  # the job's endpoint
    body: bytes  # the line's ``body`` object, as bytes, untouched
    attempts: int  # engine failures so far (refusals that asked to wait are not counted)
    group: int  # lines sharing a prompt prefix share this (sent together for the prefix cache)


@dataclass(frozen=True, slots=True)
class LineResult:
    """How a line ended. ``status_code`` and ``body`` are the response (an error response's too);
    ``error_code``/``error_message`` are set where there was no response at all (expired,
    cancelled, retries exhausted without one)."""

    batch_id: str
    line: int
    request_id: str
    status_code: int | None = None
    body: bytes | None = None
    error_code: str | None = None
    error_message: str | None = None

    @property
    def ok(self) -> bool:
        return self.status_code is not None and 200 <= self.status_code < 300


@dataclass(frozen=True, slots=True)
class Page:
    """A list page (``GET /v1/files``, ``GET /v1/batches``)."""

    items: tuple[FileRecord, ...] | tuple[BatchRecord, ...]
    has_more: bool
    extra: dict[str, str] = field(default_factory=dict)


class Fenced(Exception):
    """A write by an owner whose lease has passed to another: refused, nothing written."""
