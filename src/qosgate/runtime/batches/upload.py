"""``POST /v1/files``: a multipart/form-data upload streamed to disk as it arrives.

The body is read chunk by chunk through a streaming multipart parser (``python-multipart``):
the ``file`` part's bytes go to a staged file under the store's ``tmp/`` and are never held
whole in memory; the other fields (``purpose``) are small and kept. Lines are counted as the
bytes pass, and the file's limits (``batches.max_file_bytes``, ``batches.max_lines``) are
enforced the moment they are passed: the upload stops there and is refused (``UploadRefused``),
the staged file removed. Writes go to a worker thread, one at a time and in order, each while
the next chunk is being received: the event loop never waits on the disk.

What OpenAI checks at upload is checked here (a ``.jsonl`` file for purpose ``batch``, its
size); the lines themselves are read when a job is validated (``wire/batches.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header

# the file is handed to the disk in pieces of about this size
WRITE_CHUNK = 1 << 20
# a form field other than the file (purpose) is a word: more is refused
MAX_FIELD_BYTES = 1024
PURPOSE = "batch"  # qosgate keeps files for the Batch API only


class UploadRefused(Exception):
    """An upload that is not taken: answered ``status`` with OpenAI's error."""

    def __init__(self, message: str, param: str | None = "file", status: int = 400,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


@dataclass(frozen=True, slots=True)
class Upload:
    purpose: str
    filename: str
    staged: Path  # the file's bytes, for ``BatchStore.add_file``
    size: int
    lines: int


def boundary_of(content_type: bytes | None) -> bytes:
    """The multipart boundary of a ``Content-Type`` header, or ``UploadRefused``."""
    if content_type is None:
        raise UploadRefused("The upload must be multipart/form-data (with a file and its "
                            "purpose).", None)
    kind, params = parse_options_header(content_type)
    boundary = params.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise UploadRefused("The upload must be multipart/form-data with a boundary.", None)
    return boundary


class _Form:
    """The parser's callbacks: part headers, the fields' values, the file's bytes."""

    def __init__(self) -> None:
        self.fields: dict[str, bytes] = {}
        self.filename: str | None = None
        self.pending: list[bytes] = []  # the file's bytes parsed but not yet written
        self.complete = False
        self._header = b""
        self._headers: dict[bytes, bytes] = {}
        self._value = b""
        self._name: str | None = None
        self._in_file = False
        self._field = bytearray()

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self._part_begin, "on_header_field": self._header_field,
            "on_header_value": self._header_value, "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished, "on_part_data": self._data,
            "on_part_end": self._part_end, "on_end": self._end,
        }

    def _part_begin(self) -> None:
        self._headers = {}
        self._name = None
        self._in_file = False
        self._field = bytearray()

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header.lower()] = self._value
        self._header = self._value = b""

    def _headers_finished(self) -> None:
        _, params = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = params.get(b"name", b"").decode("utf-8", "replace")
        self._name = name
        if name == "file":
            if self.filename is not None:
                raise UploadRefused("Only one file may be uploaded at a time.")
            filename = params.get(b"filename", b"").decode("utf-8", "replace")
            if not filename.endswith(".jsonl"):
                # OpenAI's message for a batch file that is not JSONL
                raise UploadRefused("Invalid file format for Batch API. Must be .jsonl")
            self.filename = filename.rsplit("/", 1)[-1]
            self._in_file = True

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._in_file:
            piece = data[start:end]
            self.pending.append(piece)
            return
        self._field += data[start:end]
        if len(self._field) > MAX_FIELD_BYTES:
            raise UploadRefused(f"The form field {self._name!r} is too long.", self._name)

    def _part_end(self) -> None:
        if self._name is not None and not self._in_file:
            self.fields[self._name] = bytes(self._field)
        self._in_file = False

    def _end(self) -> None:
        self.complete = True


class _Writer:
    """The staged file, written by a worker thread one piece at a time, in order; each write
    runs while the next chunk is received."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f: BinaryIO | None = None
        self._pending: asyncio.Future[None] | None = None

    async def open(self) -> None:
        self._f = await asyncio.to_thread(self.path.open, "wb")

    async def write(self, data: bytes) -> None:
        await self.drain()
        f = self._f
        assert f is not None
        self._pending = asyncio.get_running_loop().run_in_executor(None, _write, f, data)

    async def drain(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            await pending

    async def close(self) -> None:
        """Everything written and on disk (a crash after ``add_file`` keeps the whole file)."""
        await self.drain()
        if self._f is not None:
            f, self._f = self._f, None
            await asyncio.to_thread(_sync_close, f)

    async def discard(self) -> None:
        with contextlib.suppress(Exception):
            await self.drain()
        if self._f is not None:
            f, self._f = self._f, None
            await asyncio.to_thread(f.close)
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(self.path.unlink)


def _write(f: BinaryIO, data: bytes) -> None:
    f.write(data)


def _sync_close(f: BinaryIO) -> None:
    f.flush()
    os.fsync(f.fileno())
    f.close()


async def receive_upload(chunks: AsyncIterator[bytes], content_type: bytes | None,
                         staged: Path, max_bytes: int, max_lines: int) -> Upload:
    """Read a ``POST /v1/files`` body from ``chunks`` into ``staged``; ``UploadRefused`` as
    soon as the body is found wrong or over a limit (the staged file is then removed; so it is
    if ``chunks`` raises: the client went away)."""
    parser_form = _Form()
    parser = MultipartParser(boundary_of(content_type), parser_form.callbacks())  # type: ignore[arg-type]
    writer = _Writer(staged)
    await writer.open()
    size = newlines = 0
    last = b"\n"
    done = False
    held: list[bytes] = []  # parsed file bytes gathered up to ``WRITE_CHUNK``
    held_size = 0
    try:
        async for chunk in chunks:
            try:
                parser.write(chunk)
            except MultipartParseError as exc:
                raise UploadRefused(f"The multipart body is malformed: {exc}.", None) from exc
            if parser_form.pending:
                pieces, parser_form.pending = parser_form.pending, []
                for piece in pieces:
                    if not piece:
                        continue
                    held.append(piece)
                    held_size += len(piece)
                    size += len(piece)
                    newlines += piece.count(b"\n")
                    last = piece[-1:]
                if size > max_bytes:
                    raise UploadRefused(
                        f"The file is over the limit of {max_bytes} bytes "
                        "(batches.max_file_bytes).", "file", 400, "file_too_large")
                if newlines > max_lines:
                    raise UploadRefused(
                        f"The file has more than {max_lines} lines, the most one batch may "
                        "have (batches.max_lines).", "file", 400, "too_many_tasks")
                if held_size >= WRITE_CHUNK:
                    await writer.write(b"".join(held))
                    held.clear()
                    held_size = 0
        if not parser_form.complete:
            raise UploadRefused("The multipart body ended before its closing boundary.", None)
        lines = newlines + (0 if last == b"\n" else 1)
        if lines > max_lines:
            raise UploadRefused(
                f"The file has more than {max_lines} lines, the most one batch may have "
                "(batches.max_lines).", "file", 400, "too_many_tasks")
        purpose = parser_form.fields.get("purpose")
        if purpose is None:
            raise UploadRefused("Missing required parameter: 'purpose'.", "purpose")
        if purpose.decode("utf-8", "replace") != PURPOSE:
            raise UploadRefused(
                f"This gateway keeps files for the Batch API only: purpose must be "
                f"{PURPOSE!r}.", "purpose")
        if parser_form.filename is None:
            raise UploadRefused("Missing required parameter: 'file'.")
        if held:
            await writer.write(b"".join(held))
        await writer.close()
        done = True
        return Upload(PURPOSE, parser_form.filename, staged, size, lines)
    finally:
        if not done:
            await writer.discard()
