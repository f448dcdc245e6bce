"""The streamed multipart upload on its own: chunks cut anywhere, limits passed mid-stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from qosgate.runtime.batches.upload import Upload, UploadRefused, receive_upload

BOUNDARY = b"----qosgate-test"
CONTENT_TYPE = b"multipart/form-data; boundary=" + BOUNDARY


def form(data: bytes, filename: str = "in.jsonl", purpose: bytes | None = b"batch") -> bytes:
    parts = []
    if purpose is not None:
        parts.append(b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="purpose"'
                     b"\r\n\r\n" + purpose + b"\r\n")
    parts.append(b"--" + BOUNDARY + b'\r\nContent-Disposition: form-data; name="file"; '
                 b'filename="' + filename.encode() + b'"\r\nContent-Type: '
                 b"application/octet-stream\r\n\r\n" + data + b"\r\n")
    return b"".join(parts) + b"--" + BOUNDARY + b"--\r\n"


async def _chunks(body: bytes, size: int, sent: list[int]) -> AsyncIterator[bytes]:
    for i in range(0, len(body), size):
        sent.append(i)
        yield body[i:i + size]


def receive(tmp_path: Path, body: bytes, size: int = 7, max_bytes: int = 1 << 20,
            max_lines: int = 100, content_type: bytes = CONTENT_TYPE) -> tuple[Upload, int]:
    sent: list[int] = []
    staged = tmp_path / "staged"
    up = asyncio.run(receive_upload(_chunks(body, size, sent), content_type, staged,
                                    max_bytes, max_lines))
    return up, len(sent)


@pytest.mark.parametrize("size", [1, 7, 64, 1 << 20])
def test_the_file_arrives_whole_however_it_is_cut(tmp_path: Path, size: int) -> None:
    data = b"".join(b'{"n": %d}\n' % i for i in range(40)) + b"\r\n--not-the-boundary\n"
    up, _ = receive(tmp_path, form(data), size)
    assert (up.purpose, up.filename, up.size, up.lines) == ("batch", "in.jsonl", len(data), 42)
    assert up.staged.read_bytes() == data


def test_a_last_line_without_newline_counts(tmp_path: Path) -> None:
    up, _ = receive(tmp_path, form(b"a\nb"))
    assert up.lines == 2


@pytest.mark.parametrize(("body", "kwargs", "param", "code"), [
    (form(b"x" * 100), {"max_bytes": 99}, "file", "file_too_large"),
    (form(b"\n" * 11), {"max_lines": 10}, "file", "too_many_tasks"),
    (form(b"\n" * 10 + b"x"), {"max_lines": 10}, "file", "too_many_tasks"),
    (form(b"x", filename="in.csv"), {}, "file", None),
    (form(b"x", purpose=b"assistants"), {}, "purpose", None),
    (form(b"x", purpose=None), {}, "purpose", None),
    (form(b"x")[:-30], {}, None, None),  # cut before the closing boundary
    (form(b"x"), {"content_type": b"application/json"}, None, None),
])
def test_refusals(tmp_path: Path, body: bytes, kwargs: dict[str, object], param: str | None,
                  code: str | None) -> None:
    with pytest.raises(UploadRefused) as e:
        receive(tmp_path, body, **kwargs)  # type: ignore[arg-type]
    assert (e.value.param, e.value.code, e.value.status) == (param, code, 400)
    assert list(tmp_path.iterdir()) == []  # the staged file is gone


def test_a_limit_stops_the_reading_at_once(tmp_path: Path) -> None:
    body = form(b"x" * 100_000)
    sent: list[int] = []

    async def go() -> None:
        await receive_upload(_chunks(body, 1000, sent), CONTENT_TYPE, tmp_path / "s", 5000, 10)

    with pytest.raises(UploadRefused):
        asyncio.run(go())
    assert len(sent) < 10  # of the ~100 chunks, only those up to the limit were read
