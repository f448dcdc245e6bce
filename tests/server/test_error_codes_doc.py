"""The errors table of the HTTP reference names every code the gateway sends itself, in the row of
its status, so the documented rule (own errors: OpenAI's shape, a string ``code`` naming the
reason) cannot drift from ``server/errors.py``."""

from __future__ import annotations

import json

from qosgate.server.errors import own_statuses, reason_error
from tests.support.files import ROOT

DOC = ROOT / "docs" / "reference" / "http-api.md"


def error_rows() -> list[str]:
    text = DOC.read_text()
    section = text[text.index("## Errors"):text.index("## Rate limits")]
    return [line for line in section.splitlines() if line.startswith("| ")]


def test_every_own_code_is_in_the_row_of_its_status() -> None:
    rows = error_rows()
    missing = [
        (code, status) for code, status in own_statuses().items()
        if not any(row.split("|")[1].strip().startswith(str(status)) and f"`{code}`" in row
                   for row in rows)
    ]
    assert missing == []


def test_own_errors_carry_a_string_code_naming_the_reason() -> None:
    for code, status in own_statuses().items():
        got_status, body = reason_error(code)
        error = json.loads(body)["error"]
        assert got_status == status and error["code"] == code


def test_a_prompt_over_the_limit_is_the_engine_s_400() -> None:
    assert own_statuses()["prompt_too_long"] == 400
