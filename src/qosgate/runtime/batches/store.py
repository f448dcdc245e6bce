"""The batch store: files, jobs and every line's state and answer in one SQLite database (WAL).

One connection, owned by one thread (a single-worker executor): every public coroutine runs its
work there, so the event loop never waits on the disk and the connection is never shared. Work
for one call is one transaction (``BEGIN IMMEDIATE``: several gateway processes may share the
database, and a fence is checked and a write made without another process's write between).

Durability: WAL with ``synchronous=NORMAL``. A commit is in the WAL file (the OS's page cache)
when it returns; a killed process (``kill -9``) loses nothing committed, and only a power loss
or OS crash may lose the last commits, never corrupt the database -- while the commit does not
wait for an fsync, which is what lets one feeder record thousands of answers a second. Files
are written under ``tmp/`` and renamed into ``files/`` (atomic): a crash leaves a whole file or
none, and what a crash left behind (staged uploads, files no row names) is removed at ``open``.

IDs are random (``file-``/``batch_`` + 24 hex digits from ``secrets``): they are unguessable, so
an id says nothing of another tenant's files or jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from qosgate.runtime.batches.records import (
    TERMINAL,
    BatchError,
    BatchRecord,
    BatchStatus,
    Fenced,
    FileRecord,
    LineResult,
    LineTask,
    Page,
)
from qosgate.wire.batches import (
    Line,
    LineProblem,
    duplicate_problem,
    empty_problem,
    model_problems,
    output_line,
    parse_line,
    too_many_problem,
)

T = TypeVar("T")

LIVE: tuple[str, ...] = ("validating", "in_progress", "finalizing", "cancelling")
# a failed validation reports this many bad lines at most (the rest are like them)
MAX_ERRORS = 100
# what a line without an answer is written to the error file with, by how its job ended
UNANSWERED: dict[str, tuple[str, str]] = {
    "expired": ("batch_expired", "This request could not be executed before the completion "
                "window expired."),
    "cancelled": ("batch_cancelled", "This request was not executed because the batch was "
                  "cancelled."),
    "completed": ("batch_incomplete", "This request was not executed."),
    "failed": ("batch_failed", "This request was not executed because the batch failed."),
}
_INSERT_CHUNK = 1000

OPEN_TIMEOUT_S = 30.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    purpose TEXT NOT NULL,
    filename TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    lines INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, seq);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    qos_class TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    output_file_id TEXT,
    error_file_id TEXT,
    metadata TEXT,
    errors TEXT,
    fence INTEGER NOT NULL DEFAULT 0,
    model TEXT,
    ending TEXT  -- the status a job that is being finished ends in (a resumed finish reads it)
);
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, seq);
CREATE INDEX IF NOT EXISTS batches_live ON batches (status, expires_at);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL,
    line INTEGER NOT NULL,
    custom_id TEXT NOT NULL,
    body BLOB NOT NULL,
    grp INTEGER NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    answered INTEGER NOT NULL DEFAULT 0,
    status_code INTEGER,
    response BLOB,
    error_code TEXT,
    error_message TEXT,
    request_id TEXT,
    PRIMARY KEY (batch_id, line)
);
-- next_lines: a job's unanswered lines by (group, line)
CREATE INDEX IF NOT EXISTS lines_todo ON lines (batch_id, grp, line) WHERE answered = 0;
"""

_BATCH_COLUMNS = (
    "id, tenant, endpoint, input_file_id, completion_window, status, qos_class, created_at, "
    "expires_at, total, completed, failed, in_progress_at, finalizing_at, completed_at, "
    "failed_at, expired_at, cancelling_at, cancelled_at, output_file_id, error_file_id, "
    "metadata, errors, fence, model"
)
_FILE_COLUMNS = "id, tenant, purpose, filename, bytes, created_at, lines"


def new_id(prefix: str) -> str:
    """A random id: ``prefix`` and 24 hex digits (96 bits from ``secrets``)."""
    return prefix + secrets.token_hex(12)


def _file(row: sqlite3.Row) -> FileRecord:
    return FileRecord(row["id"], row["tenant"], row["purpose"], row["filename"], row["bytes"],
                      row["created_at"], row["lines"])


def _errors_json(errors: Sequence[BatchError]) -> str | None:
    if not errors:
        return None
    return json.dumps([{"code": e.code, "message": e.message, "param": e.param, "line": e.line}
                       for e in errors])


def _batch(row: sqlite3.Row) -> BatchRecord:
    errors = tuple(BatchError(**e) for e in json.loads(row["errors"])) if row["errors"] else ()
    metadata = json.loads(row["metadata"]) if row["metadata"] else None
    return BatchRecord(
        id=row["id"], tenant=row["tenant"], endpoint=row["endpoint"],
        input_file_id=row["input_file_id"], completion_window=row["completion_window"],
        status=row["status"], qos_class=row["qos_class"], created_at=row["created_at"],
        expires_at=row["expires_at"], total=row["total"], completed=row["completed"],
        failed=row["failed"], in_progress_at=row["in_progress_at"],
        finalizing_at=row["finalizing_at"], completed_at=row["completed_at"],
        failed_at=row["failed_at"], expired_at=row["expired_at"],
        cancelling_at=row["cancelling_at"], cancelled_at=row["cancelled_at"],
        output_file_id=row["output_file_id"], error_file_id=row["error_file_id"],
        metadata=metadata, errors=errors, fence=row["fence"], model=row["model"],
    )


class BatchStore:
    def __init__(self, directory: Path, wall: Callable[[], float],
                 max_lines: int | None = None) -> None:
        """``directory`` holds ``batches.sqlite3`` and ``files/``; ``wall`` is the Unix clock;
        ``max_lines``: a job's file with more requests fails validation (``too_many_tasks``)."""
        self.directory = Path(directory)
        self.max_lines = max_lines
        self.files_dir = self.directory / "files"
        self.tmp_dir = self.directory / "tmp"
        self.wall = wall
        self._pool: ThreadPoolExecutor | None = None
        self._db: sqlite3.Connection | None = None

    # ----------------------------------------------------------------- the thread
    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._pool is None:
            raise RuntimeError("the batch store is not open")
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    @property
    def db(self) -> sqlite3.Connection:
        assert self._db is not None, "the batch store is not open"
        return self._db

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction, taken at once (``IMMEDIATE``): a fence read in it holds
        until it commits."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")

    def _now(self) -> int:
        return int(self.wall())

    async def open(self) -> None:
        """Create or migrate the schema; WAL; start the store's thread."""
        if self._pool is not None:
            return
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-store")
        await self._run(self._open)

    def _open(self) -> None:
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.tmp_dir.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.directory / "batches.sqlite3", isolation_level=None,
                             timeout=OPEN_TIMEOUT_S)
        db.row_factory = sqlite3.Row
        # Processes opening one new database together (``serve --workers 2``) can get "database
        # is locked" at once from the switch to WAL or the schema, without SQLite's busy wait
        # (a worker then failed to start): the steps are idempotent, so try them again.
        deadline = time.monotonic() + OPEN_TIMEOUT_S
        while True:
            try:
                db.execute("PRAGMA journal_mode=WAL")
                db.execute("PRAGMA synchronous=NORMAL")
                db.executescript(_SCHEMA)
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._db = db
        self._sweep()

    def _sweep(self) -> None:
        """Remove what a crash left: staged uploads and output files no row names. Another
        process sharing the directory may be staging an upload right now: only what is older
        than a day goes from ``tmp/``."""
        cutoff = self.wall() - 86_400
        for p in self.tmp_dir.iterdir():
            with contextlib.suppress(OSError):
                if p.stat().st_mtime < cutoff:
                    p.unlink()
        known = {r[0] for r in self.db.execute("SELECT id FROM files")}
        for p in self.files_dir.iterdir():
            if p.name not in known:
                with contextlib.suppress(OSError):
                    if p.stat().st_mtime < cutoff:
                        p.unlink()

    async def close(self) -> None:
        pool = self._pool
        if pool is None:
            return
        await self._run(self._close)
        self._pool = None
        pool.shutdown(wait=True)

    def _close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    # ----------------------------------------------------------------- files
    def file_path(self, file_id: str) -> Path:
        if "/" in file_id or file_id.startswith("."):
            raise ValueError(f"not a file id: {file_id!r}")
        return self.files_dir / file_id

    def staging_path(self) -> Path:
        """A new path under ``tmp/`` to stream an upload to (``add_file`` takes it in)."""
        return self.tmp_dir / f"upload-{secrets.token_hex(8)}"

    async def add_file(self, tenant: str, purpose: str, filename: str, staged: Path, size: int,
                       lines: int) -> FileRecord:
        """Take an upload already streamed to ``staged`` (under ``directory``) as a new file."""
        return await self._run(self._add_file, tenant, purpose, filename, staged, size, lines)

    def _add_file(self, tenant: str, purpose: str, filename: str, staged: Path, size: int,
                  lines: int) -> FileRecord:
        rec = FileRecord(new_id("file-"), tenant, purpose, filename, size, self._now(), lines)
        os.replace(staged, self.file_path(rec.id))
        with self._tx() as db:
            self._insert_file(db, rec)
        return rec

    @staticmethod
    def _insert_file(db: sqlite3.Connection, rec: FileRecord) -> None:
        db.execute(f"INSERT INTO files ({_FILE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?)",
                   (rec.id, rec.tenant, rec.purpose, rec.filename, rec.bytes, rec.created_at,
                    rec.lines))

    async def file(self, file_id: str, tenant: str) -> FileRecord | None:
        """The file if ``tenant`` owns it (another tenant's file is None: not found)."""
        return await self._run(self._file_of, file_id, tenant)

    def _file_of(self, file_id: str, tenant: str | None) -> FileRecord | None:
        row = self.db.execute(f"SELECT {_FILE_COLUMNS} FROM files WHERE id = ?",
                              (file_id,)).fetchone()
        if row is None or (tenant is not None and row["tenant"] != tenant):
            return None
        return _file(row)

    async def files(self, tenant: str, purpose: str | None, after: str | None, limit: int,
                    order: str = "desc") -> Page:
        return await self._run(self._files, tenant, purpose, after, limit, order)

    def _files(self, tenant: str, purpose: str | None, after: str | None, limit: int,
               order: str) -> Page:
        desc = order != "asc"
        where, args = self._page_where("files", tenant, after, desc)
        if purpose is not None:
            where += " AND purpose = ?"
            args.append(purpose)
        rows = self.db.execute(
            f"SELECT {_FILE_COLUMNS} FROM files WHERE {where} "
            f"ORDER BY seq {'DESC' if desc else 'ASC'} LIMIT ?", (*args, limit + 1)).fetchall()
        return Page(tuple(_file(r) for r in rows[:limit]), len(rows) > limit)

    def _page_where(self, table: str, tenant: str | None, after: str | None,
                    desc: bool) -> tuple[str, list[Any]]:
        """The rows of ``tenant`` (None: all) past the cursor ``after`` (an id of the list)."""
        where, args = "1", []
        if tenant is not None:
            where, args = "tenant = ?", [tenant]
        if after:
            row = self.db.execute(f"SELECT seq, tenant FROM {table} WHERE id = ?",
                                  (after,)).fetchone()
            if row is not None and (tenant is None or row["tenant"] == tenant):
                where += f" AND seq {'<' if desc else '>'} ?"
                args.append(row["seq"])
        return where, args

    async def delete_file(self, file_id: str, tenant: str) -> bool:
        return await self._run(self._delete_file, file_id, tenant)

    def _delete_file(self, file_id: str, tenant: str) -> bool:
        with self._tx() as db:
            gone = db.execute("DELETE FROM files WHERE id = ? AND tenant = ?",
                              (file_id, tenant)).rowcount > 0
        if gone:
            with contextlib.suppress(FileNotFoundError):
                self.file_path(file_id).unlink()
        return gone

    # ----------------------------------------------------------------- jobs (HTTP side)
    async def create_batch(self, tenant: str, input_file_id: str, endpoint: str,
                           completion_window: str, completion_window_s: float, qos_class: str,
                           metadata: dict[str, str] | None) -> BatchRecord:
        """A new job in ``validating``; its lines are read by ``validate``."""
        return await self._run(self._create_batch, tenant, input_file_id, endpoint,
                               completion_window, completion_window_s, qos_class, metadata)

    def _create_batch(self, tenant: str, input_file_id: str, endpoint: str,
                      completion_window: str, completion_window_s: float, qos_class: str,
                      metadata: dict[str, str] | None) -> BatchRecord:
        now = self._now()
        rec = BatchRecord(id=new_id("batch_"), tenant=tenant, endpoint=endpoint,
                          input_file_id=input_file_id, completion_window=completion_window,
                          status="validating", qos_class=qos_class, created_at=now,
                          expires_at=now + int(completion_window_s), metadata=metadata)
        with self._tx() as db:
            db.execute(
                "INSERT INTO batches (id, tenant, endpoint, input_file_id, completion_window, "
                "status, qos_class, created_at, expires_at, metadata) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (rec.id, tenant, endpoint, input_file_id, completion_window, rec.status,
                 qos_class, now, rec.expires_at,
                 json.dumps(metadata) if metadata is not None else None))
        return rec

    async def batch(self, batch_id: str, tenant: str | None) -> BatchRecord | None:
        """The job if ``tenant`` owns it (None: any tenant, for the feeder and admins)."""
        return await self._run(self._batch_of, batch_id, tenant)

    def _batch_of(self, batch_id: str, tenant: str | None) -> BatchRecord | None:
        row = self.db.execute(f"SELECT {_BATCH_COLUMNS} FROM batches WHERE id = ?",
                              (batch_id,)).fetchone()
        if row is None or (tenant is not None and row["tenant"] != tenant):
            return None
        return _batch(row)

    async def batches(self, tenant: str | None, after: str | None, limit: int) -> Page:
        """Newest first, as OpenAI lists them; ``tenant`` None: every tenant's (status)."""
        return await self._run(self._batches, tenant, after, limit)

    def _batches(self, tenant: str | None, after: str | None, limit: int) -> Page:
        where, args = self._page_where("batches", tenant, after, True)
        rows = self.db.execute(
            f"SELECT {_BATCH_COLUMNS} FROM batches WHERE {where} ORDER BY seq DESC LIMIT ?",
            (*args, limit + 1)).fetchall()
        return Page(tuple(_batch(r) for r in rows[:limit]), len(rows) > limit)

    async def request_cancel(self, batch_id: str, tenant: str) -> BatchRecord | None:
        """``cancelling`` (the feeder stops its lines and ends it ``cancelled``); a job that
        has ended is returned as it is."""
        return await self._run(self._request_cancel, batch_id, tenant)

    def _request_cancel(self, batch_id: str, tenant: str) -> BatchRecord | None:
        with self._tx() as db:
            db.execute(
                "UPDATE batches SET status = 'cancelling', cancelling_at = ? "
                "WHERE id = ? AND tenant = ? AND status IN ('validating', 'in_progress')",
                (self._now(), batch_id, tenant))
        return self._batch_of(batch_id, tenant)

    # ----------------------------------------------------------------- jobs (feeder side)
    def _check_fence(self, db: sqlite3.Connection, batch_id: str, fence: int) -> sqlite3.Row:
        row = db.execute(f"SELECT {_BATCH_COLUMNS}, ending FROM batches WHERE id = ?",
                         (batch_id,)).fetchone()
        if row is None:
            raise KeyError(batch_id)
        if row["fence"] != fence:
            raise Fenced(f"{batch_id}: fence {fence}, held by {row['fence']}")
        found: sqlite3.Row = row
        return found

    async def validate(self, batch_id: str, serves: Callable[[str], bool],
                       fence: int) -> BatchRecord:
        """Read the job's input file line by line into its lines (never whole in memory):
        ``in_progress``, or ``failed`` with ``errors`` as OpenAI reports a bad file.
        ``serves(model)`` says whether a model is served. A job no longer ``validating`` (a
        second call, a cancel) is returned as it is. Raises ``Fenced``."""
        return await self._run(self._validate, batch_id, serves, fence)

    def _validate(self, batch_id: str, serves: Callable[[str], bool],
                  fence: int) -> BatchRecord:
        with self._tx() as db:
            row = self._check_fence(db, batch_id, fence)
            if row["status"] != "validating":
                return _batch(row)
            now = self._now()
            path = self.file_path(row["input_file_id"])
            known = db.execute("SELECT 1 FROM files WHERE id = ? AND tenant = ?",
                               (row["input_file_id"], row["tenant"])).fetchone()
            if known is None or not path.exists():
                errors: list[BatchError] = [BatchError(
                    "invalid_file", f"The input file {row['input_file_id']!r} no longer "
                    "exists.", "input_file_id")]
                model = None
                total = 0
            else:
                errors, model, total = self._read_lines(db, batch_id, row["endpoint"], path,
                                                        serves)
            if errors:
                db.execute("DELETE FROM lines WHERE batch_id = ?", (batch_id,))
                db.execute("UPDATE batches SET status = 'failed', failed_at = ?, errors = ? "
                           "WHERE id = ?", (now, _errors_json(errors), batch_id))
            else:
                db.execute("UPDATE batches SET status = 'in_progress', in_progress_at = ?, "
                           "total = ?, model = ? WHERE id = ?", (now, total, model, batch_id))
        rec = self._batch_of(batch_id, None)
        assert rec is not None
        return rec

    def _read_lines(self, db: sqlite3.Connection, batch_id: str, endpoint: str, path: Path,
                    serves: Callable[[str], bool]) -> tuple[list[BatchError], str | None, int]:
        """Insert the lines of ``path`` (in chunks, inside the caller's transaction) while
        checking them; (errors, model, lines). After the first error nothing more is inserted
        (the caller rolls the lines back) but the checks go on, up to ``MAX_ERRORS``."""
        errors: list[BatchError] = []
        seen: set[str] = set()
        groups: dict[int, int] = {}  # a prefix key -> the first line that has it
        model: str | None = None
        served = False
        rows: list[tuple[Any, ...]] = []
        n = 0
        max_lines = self.max_lines

        def bad(problem: LineProblem, lineno: int | None) -> None:
            if len(errors) < MAX_ERRORS:
                errors.append(BatchError(problem.code, problem.message, problem.param, lineno))

        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                raw = raw.rstrip(b"\r\n")
                if not raw.strip():
                    continue
                if max_lines is not None and n >= max_lines:
                    bad(too_many_problem(max_lines), None)
                    break
                parsed = parse_line(raw, endpoint)
                if isinstance(parsed, Line):
                    if model is None:
                        model, served = parsed.model, serves(parsed.model)
                    problem = model_problems(parsed.model, model, served)
                    if problem is None and parsed.custom_id in seen:
                        problem = duplicate_problem(parsed.custom_id)
                    seen.add(parsed.custom_id)
                else:
                    problem = parsed
                if problem is not None:
                    bad(problem, lineno)
                    if len(errors) >= MAX_ERRORS:
                        break
                    continue
                assert isinstance(parsed, Line)
                if not errors:
                    grp = groups.setdefault(parsed.group, n)
                    rows.append((batch_id, n, parsed.custom_id, parsed.body, grp))
                    if len(rows) >= _INSERT_CHUNK:
                        self._insert_lines(db, rows)
                n += 1
        if not errors and n == 0:
            bad(empty_problem(), None)
        if not errors:
            self._insert_lines(db, rows)
        return errors, model, n

    @staticmethod
    def _insert_lines(db: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
        db.executemany("INSERT INTO lines (batch_id, line, custom_id, body, grp) "
                       "VALUES (?, ?, ?, ?, ?)", rows)
        rows.clear()

    async def live(self) -> list[BatchRecord]:
        """Jobs not ended (validating, in_progress, finalizing, cancelling), by deadline."""
        return await self._run(self._live)

    def _live(self) -> list[BatchRecord]:
        rows = self.db.execute(
            f"SELECT {_BATCH_COLUMNS} FROM batches WHERE status IN ({','.join('?' * len(LIVE))})"
            " ORDER BY expires_at, seq", LIVE).fetchall()
        return [_batch(r) for r in rows]

    async def claim(self, batch_id: str, fence: int) -> bool:
        """Record ``fence`` as the job's owner token if it is newer than the one stored. True
        if the job is now ``fence``'s (a claim again with the stored fence is True too); False
        if a newer owner holds it, or there is no such job."""
        return await self._run(self._claim, batch_id, fence)

    def _claim(self, batch_id: str, fence: int) -> bool:
        with self._tx() as db:
            db.execute("UPDATE batches SET fence = ? WHERE id = ? AND fence < ?",
                       (fence, batch_id, fence))
            row = db.execute("SELECT fence FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row is not None and row["fence"] == fence

    async def next_lines(self, batch_id: str, n: int, skip: Sequence[int]) -> list[LineTask]:
        """Up to ``n`` lines without an answer, not in ``skip`` (running or waiting to retry),
        lines sharing a prompt prefix together, else in file order."""
        return await self._run(self._next_lines, batch_id, n, frozenset(skip))

    def _next_lines(self, batch_id: str, n: int, skip: frozenset[int]) -> list[LineTask]:
        if n <= 0:
            return []
        row = self.db.execute("SELECT endpoint FROM batches WHERE id = ?",
                              (batch_id,)).fetchone()
        if row is None:
            return []
        url = row["endpoint"]
        # the skipped lines are few (those running or waiting): read past them rather than
        # hand SQLite a list to exclude
        rows = self.db.execute(
            "SELECT line, custom_id, body, attempts, grp FROM lines "
            "WHERE batch_id = ? AND answered = 0 ORDER BY grp, line LIMIT ?",
            (batch_id, n + len(skip))).fetchall()
        out = [LineTask(batch_id, r["line"], r["custom_id"], url, bytes(r["body"]),
                        r["attempts"], r["grp"])
               for r in rows if r["line"] not in skip]
        return out[:n]

    async def record(self, fence: int, results: Sequence[LineResult]) -> int:
        """Write answers (one transaction; lines already answered are left as they are: nothing
        is answered twice). Raises ``Fenced`` if another owner holds the job. Returns how many
        were written."""
        if not results:
            return 0
        return await self._run(self._record, fence, results)

    def _record(self, fence: int, results: Sequence[LineResult]) -> int:
        written = 0
        with self._tx() as db:
            for batch_id in {r.batch_id for r in results}:
                self._check_fence(db, batch_id, fence)
            counts: dict[str, list[int]] = {}
            for r in results:
                changed = db.execute(
                    "UPDATE lines SET answered = 1, status_code = ?, response = ?, "
                    "error_code = ?, error_message = ?, request_id = ? "
                    "WHERE batch_id = ? AND line = ? AND answered = 0",
                    (r.status_code, r.body, r.error_code, r.error_message, r.request_id,
                     r.batch_id, r.line)).rowcount
                if changed:
                    written += 1
                    c = counts.setdefault(r.batch_id, [0, 0])
                    c[0 if r.ok else 1] += 1
            for batch_id, (ok, failed) in counts.items():
                db.execute("UPDATE batches SET completed = completed + ?, failed = failed + ? "
                           "WHERE id = ?", (ok, failed, batch_id))
        return written

    async def count_attempt(self, batch_id: str, line: int, fence: int) -> None:
        """One more engine failure of a line (its retries are counted across restarts).
        Raises ``Fenced``."""
        await self._run(self._count_attempt, batch_id, line, fence)

    def _count_attempt(self, batch_id: str, line: int, fence: int) -> None:
        with self._tx() as db:
            self._check_fence(db, batch_id, fence)
            db.execute("UPDATE lines SET attempts = attempts + 1 WHERE batch_id = ? AND line = ?",
                       (batch_id, line))

    async def finish(self, batch_id: str, fence: int, status: BatchStatus,
                     errors: Sequence[BatchError] = ()) -> BatchRecord:
        """End a job: lines without an answer get ``error_code`` (``batch_expired``,
        ``batch_cancelled``) in the error file; output and error files written (streamed);
        ``finalizing`` then ``status`` with their timestamps.

        The lines without an answer are marked in the same transaction that records the end
        begun (so nothing can be answered after it); a finish interrupted by a crash is done
        again by the next call, which ends the job as the first call asked (whatever
        ``status`` it gives). A job that has ended is returned as it is. Raises ``Fenced``."""
        return await self._run(self._finish, batch_id, fence, status, tuple(errors))

    def _finish(self, batch_id: str, fence: int, status: BatchStatus,
                errors: tuple[BatchError, ...]) -> BatchRecord:
        now = self._now()
        with self._tx() as db:
            row = self._check_fence(db, batch_id, fence)
            if row["status"] in TERMINAL:
                return _batch(row)
            if row["ending"] is not None:
                status = row["ending"]
            else:
                code, message = UNANSWERED[status]
                failed = db.execute(
                    "UPDATE lines SET answered = 1, error_code = ?, error_message = ? "
                    "WHERE batch_id = ? AND answered = 0", (code, message, batch_id)).rowcount
                sets = "ending = ?, failed = failed + ?"
                args: list[Any] = [status, failed]
                if status == "completed":
                    sets += ", status = 'finalizing', finalizing_at = ?"
                    args.append(now)
                if errors:
                    sets += ", errors = ?"
                    args.append(_errors_json(errors))
                db.execute(f"UPDATE batches SET {sets} WHERE id = ?", (*args, batch_id))
        # the files, outside any transaction: a long write must not hold the database
        output, error = self._write_results(batch_id, row["tenant"])
        written = [r for r in (output, error) if r is not None]
        try:
            with self._tx() as db:
                self._check_fence(db, batch_id, fence)
                for rec in written:
                    self._insert_file(db, rec)
                    os.replace(self.tmp_dir / rec.id, self.file_path(rec.id))
        except BaseException:
            for rec in written:
                with contextlib.suppress(OSError):
                    (self.tmp_dir / rec.id).unlink()
            raise
        with self._tx() as db:
            stamp = {"completed": "completed_at", "failed": "failed_at",
                     "expired": "expired_at", "cancelled": "cancelled_at"}[status]
            db.execute(
                f"UPDATE batches SET status = ?, {stamp} = ?, output_file_id = ?, "
                "error_file_id = ?, ending = NULL WHERE id = ?",
                (status, now, output.id if output else None, error.id if error else None,
                 batch_id))
        ended = self._batch_of(batch_id, None)
        assert ended is not None
        return ended

    def _write_results(self, batch_id: str,
                       tenant: str) -> tuple[FileRecord | None, FileRecord | None]:
        """The output file (2xx answers) and the error file (the rest) of a job, in file
        order, written line by line to ``tmp/`` (not yet in ``files/``); None: no such
        lines (OpenAI leaves the id null)."""
        now = self._now()
        ids = {"out": new_id("file-"), "err": new_id("file-")}
        sizes = {"out": 0, "err": 0}
        counts = {"out": 0, "err": 0}
        paths = {k: self.tmp_dir / v for k, v in ids.items()}
        with paths["out"].open("wb") as out, paths["err"].open("wb") as err:
            rows = self.db.execute(
                "SELECT line, custom_id, status_code, response, error_code, error_message, "
                "request_id FROM lines WHERE batch_id = ? ORDER BY line", (batch_id,))
            for r in rows:
                code = r["status_code"]
                data = output_line(batch_id, r["line"], r["custom_id"], code, r["request_id"],
                                   r["response"], r["error_code"], r["error_message"])
                key = "out" if code is not None and 200 <= code < 300 else "err"
                (out if key == "out" else err).write(data)
                sizes[key] += len(data)
                counts[key] += 1
            for f in (out, err):
                f.flush()
                os.fsync(f.fileno())
        recs: dict[str, FileRecord | None] = {}
        # named and typed as OpenAI's: both files are of purpose batch_output
        for key, name in (("out", "output"), ("err", "error")):
            if counts[key]:
                recs[key] = FileRecord(ids[key], tenant, "batch_output",
                                       f"{batch_id}_{name}.jsonl", sizes[key], now, counts[key])
            else:
                paths[key].unlink()
                recs[key] = None
        return recs["out"], recs["err"]

    async def stats(self) -> dict[str, int]:
        """Jobs by status and lines by outcome, for metrics and status: ``jobs_<status>``
        for every status, ``lines_completed``, ``lines_failed`` (all jobs) and
        ``lines_pending`` (jobs not ended)."""
        return await self._run(self._stats)

    def _stats(self) -> dict[str, int]:
        out = {f"jobs_{s}": 0 for s in (*LIVE, *sorted(TERMINAL))}
        for r in self.db.execute("SELECT status, COUNT(*) AS n FROM batches GROUP BY status"):
            out[f"jobs_{r['status']}"] = r["n"]
        row = self.db.execute(
            "SELECT COALESCE(SUM(completed), 0) AS c, COALESCE(SUM(failed), 0) AS f, "
            "COALESCE(SUM(CASE WHEN status IN ('validating', 'in_progress', 'finalizing', "
            "'cancelling') THEN total - completed - failed ELSE 0 END), 0) AS p "
            "FROM batches").fetchone()
        out.update(lines_completed=row["c"], lines_failed=row["f"], lines_pending=row["p"])
        return out
