"""The compatibility page carries the table of the rows its real-vLLM test checks."""

from __future__ import annotations

from tests.support.fidelity import render
from tests.support.files import ROOT


def test_the_compatibility_page_carries_the_tested_rows() -> None:
    doc = (ROOT / "docs" / "reference" / "compatibility.md").read_text()
    table = render()
    assert table in doc, (
        "docs/reference/compatibility.md: paste the table again:\n" + table)
