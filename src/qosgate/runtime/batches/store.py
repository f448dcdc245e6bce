"""The batch store: files, jobs and every line's state and answer in one SQLite database (WAL).

INTERFACE SKELETON (the store helper implements it; signatures are the contract the feeder and
the HTTP routes code against). One connection, owned by one thread; every method is a coroutine
that runs its work on that thread, so the event loop never waits on the disk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from qosgate.runtime.batches.records import (
    BatchError,
    BatchRecord,
    BatchStatus,
    FileRecord,
    LineResult,
    LineTask,
    Page,
)


class BatchStore:
    def __init__(self, directory: Path, wall: Callable[[], float]) -> None:
        """``directory`` holds ``batches.sqlite3`` and ``files/``; ``wall`` is the Unix clock."""
        raise NotImplementedError

    async def open(self) -> None:
        """Create or migrate the schema; WAL; start the store's thread."""
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError

    # ----------------------------------------------------------------- files
    def file_path(self, file_id: str) -> Path:
        raise NotImplementedError

    async def add_file(self, tenant: str, purpose: str, filename: str, staged: Path, size: int,
                       lines: int) -> FileRecord:
        """Take an upload already streamed to ``staged`` (under ``directory``) as a new file."""
        raise NotImplementedError

    async def file(self, file_id: str, tenant: str) -> FileRecord | None:
        """The file if ``tenant`` owns it (another tenant's file is None: not found)."""
        raise NotImplementedError

    async def files(self, tenant: str, purpose: str | None, after: str | None, limit: int,
                    order: str = "desc") -> Page:
        raise NotImplementedError

    async def delete_file(self, file_id: str, tenant: str) -> bool:
        raise NotImplementedError

    # ----------------------------------------------------------------- jobs (HTTP side)
    async def create_batch(self, tenant: str, input_file_id: str, endpoint: str,
                           completion_window: str, window_s: float, qos_class: str,
                           metadata: dict[str, str] | None) -> BatchRecord:
        """A new job in ``validating``; its lines are read by ``validate``."""
        raise NotImplementedError

    async def batch(self, batch_id: str, tenant: str | None) -> BatchRecord | None:
        """The job if ``tenant`` owns it (None: any tenant, for the feeder and admins)."""
        raise NotImplementedError

    async def batches(self, tenant: str | None, after: str | None, limit: int) -> Page:
        """Newest first, as OpenAI lists them; ``tenant`` None: every tenant's (status)."""
        raise NotImplementedError

    async def request_cancel(self, batch_id: str, tenant: str) -> BatchRecord | None:
        """``cancelling`` (the feeder stops its lines and ends it ``cancelled``); a job that
        has ended is returned as it is."""
        raise NotImplementedError

    # ----------------------------------------------------------------- jobs (feeder side)
    async def validate(self, batch_id: str, serves: Callable[[str], bool],
                       fence: int) -> BatchRecord:
        """Read the job's input file line by line into its lines (never whole in memory):
        ``in_progress``, or ``failed`` with ``errors`` as OpenAI reports a bad file.
        ``serves(model)`` says whether a model is served."""
        raise NotImplementedError

    async def live(self) -> list[BatchRecord]:
        """Jobs not ended (validating, in_progress, finalizing, cancelling), by deadline."""
        raise NotImplementedError

    async def claim(self, batch_id: str, fence: int) -> bool:
        """Record ``fence`` as the job's owner token if it is newer than the one stored."""
        raise NotImplementedError

    async def next_lines(self, batch_id: str, n: int, skip: Sequence[int]) -> list[LineTask]:
        """Up to ``n`` lines without an answer, not in ``skip`` (running or waiting to retry),
        lines sharing a prompt prefix together, else in file order."""
        raise NotImplementedError

    async def record(self, fence: int, results: Sequence[LineResult]) -> int:
        """Write answers (one transaction; lines already answered are left as they are: nothing
        is answered twice). Raises ``Fenced`` if another owner holds the job. Returns how many
        were written."""
        raise NotImplementedError

    async def count_attempt(self, batch_id: str, line: int, fence: int) -> None:
        raise NotImplementedError

    async def finish(self, batch_id: str, fence: int, status: BatchStatus,
                     errors: Sequence[BatchError] = ()) -> BatchRecord:
        """End a job: lines without an answer get ``error_code`` (``batch_expired``,
        ``batch_cancelled``) in the error file; output and error files written (streamed);
        ``finalizing`` then ``status`` with their timestamps."""
        raise NotImplementedError

    async def stats(self) -> dict[str, int]:
        """Jobs by status and lines by outcome, for metrics and status."""
        raise NotImplementedError
