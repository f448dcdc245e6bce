"""The Batch API's wire pieces: one input line read, the objects and output lines as OpenAI's
(checked against the ``openai`` client's own types)."""

from __future__ import annotations

import json

import pytest
from openai.types import Batch, FileObject

from qosgate.runtime.batches.records import BatchError, BatchRecord, FileRecord
from qosgate.wire.batches import (
    Line,
    LineProblem,
    batch_object,
    completion_window_seconds,
    file_object,
    group_key,
    list_object,
    output_line,
    parse_line,
    request_id_of,
)

CHAT = "/v1/chat/completions"


def raw(**members: object) -> bytes:
    base: dict[str, object] = {"custom_id": "a", "method": "POST", "url": CHAT,
                               "body": {"model": "m", "messages": [{"role": "user",
                                                                    "content": "hi"}]}}
    base.update(members)
    return json.dumps(base).encode()


def test_a_good_line_keeps_its_body_untouched() -> None:
    body = b'{"model": "m", "messages": [{"role":"user","content":"h\\u00e9"}], "x": 1}'
    got = parse_line(b'{"custom_id": "a", "method": "POST", "url": "' + CHAT.encode()
                     + b'", "body": ' + body + b"}", CHAT)
    assert isinstance(got, Line)
    assert (got.custom_id, got.body, got.model) == ("a", body, "m")


@pytest.mark.parametrize(("line", "code", "param"), [
    (b"{", "invalid_json_line", None),
    (b'"a string"', "invalid_json_line", None),
    (raw(custom_id=7), "invalid_request", "custom_id"),
    (raw(custom_id=""), "invalid_request", "custom_id"),
    (raw(custom_id="x" * 65), "invalid_request", "custom_id"),
    (raw(method="GET"), "invalid_request", "method"),
    (raw(url=5), "invalid_request", "url"),
    (raw(url="/v1/embeddings"), "url_mismatch", "url"),
    (raw(body=[1]), "invalid_request", "body"),
    (raw(body={"messages": []}), "invalid_request", "body.model"),
    (raw(body={"model": "m", "messages": [], "stream": True}), "invalid_request",
     "body.stream"),
])
def test_bad_lines_say_why_with_openai_codes(line: bytes, code: str,
                                             param: str | None) -> None:
    got = parse_line(line, CHAT)
    assert isinstance(got, LineProblem)
    assert (got.code, got.param) == (code, param)


def test_group_keys_follow_the_prompt_head() -> None:
    head = "x" * 600
    a = parse_line(raw(body={"model": "m", "messages": [{"role": "user",
                                                         "content": head + "1"}]}), CHAT)
    b = parse_line(raw(body={"model": "m", "messages": [{"role": "user",
                                                         "content": head + "2"}]}), CHAT)
    c = parse_line(raw(body={"model": "m", "messages": [{"role": "user", "content": "1"}]}),
                   CHAT)
    assert isinstance(a, Line) and isinstance(b, Line) and isinstance(c, Line)
    assert a.group == b.group != c.group
    assert group_key("m", b"same") != group_key("n", b"same")
    assert 0 <= group_key("m", b"\xff" * 600) < 1 << 63  # a signed 64-bit SQLite integer


def test_windows() -> None:
    assert completion_window_seconds("24h") == 86_400
    assert completion_window_seconds("90m") == 5400
    assert completion_window_seconds("2d") == 172_800
    assert completion_window_seconds("1.5h") == 5400
    for bad in ("", "h", "24", "-1h", "0h", "24x", "infh", "nanh"):
        assert completion_window_seconds(bad) is None


def test_objects_are_the_openai_clients_types() -> None:
    f = FileRecord("file-1", "t", "batch", "in.jsonl", 10, 1_700_000_000, 2)
    assert FileObject.model_validate(file_object(f)).model_dump(exclude_none=True) == {
        "id": "file-1", "object": "file", "bytes": 10, "created_at": 1_700_000_000,
        "filename": "in.jsonl", "purpose": "batch", "status": "processed"}
    b = BatchRecord("batch_1", "t", CHAT, "file-1", "24h", "failed", "batch", 5, 9,
                    total=3, completed=1, failed=2, failed_at=7, metadata={"k": "v"},
                    errors=(BatchError("invalid_json_line", "bad", None, 2),), model="m")
    parsed = Batch.model_validate(batch_object(b))
    assert set(batch_object(b)) <= set(Batch.model_fields)
    assert parsed.request_counts is not None and parsed.request_counts.failed == 2
    assert parsed.errors is not None and parsed.errors.object == "list"
    assert parsed.errors.data is not None and parsed.errors.data[0].line == 2
    assert (parsed.status, parsed.failed_at, parsed.model) == ("failed", 7, "m")
    assert batch_object(BatchRecord("batch_2", "t", CHAT, "f", "24h", "validating", "batch",
                                    1, 2))["errors"] is None
    page = list_object([file_object(f)], False)
    assert (page["object"], page["first_id"], page["last_id"], page["has_more"]) == (
        "list", "file-1", "file-1", False)


def test_output_lines() -> None:
    ok = json.loads(output_line("batch_1", 0, "a", 200, "r", b'{"x": 1}', None, None))
    assert ok == {"id": request_id_of("batch_1", 0), "custom_id": "a",
                  "response": {"status_code": 200, "request_id": "r", "body": {"x": 1}},
                  "error": None}
    gone = json.loads(output_line("batch_1", 1, "b", None, None, None, "batch_expired", "late"))
    assert gone["response"] is None
    assert gone["error"] == {"code": "batch_expired", "message": "late"}
    assert request_id_of("batch_1", 0) != request_id_of("batch_1", 1)
    assert request_id_of("batch_1", 0).startswith("batch_req_")
