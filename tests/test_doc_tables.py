"""The docs' cheap simulator tables, re-run: what a documented command prints is what the docs
show (``scripts/doc_tables.py --cheap``; the whole check, ``scripts/doc_tables.py``, takes tens
of minutes and is run by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.files import load_module

ROOT = Path(__file__).resolve().parents[1]


DT = load_module("scripts/doc_tables.py")
TABLES = [t for f in DT.doc_files() for t in DT.find_tables(f)]
CHEAP = [t for t in TABLES if t.cheap and not t.skip]


def test_the_docs_have_doc_tables_and_a_cheap_subset() -> None:
    assert len(TABLES) >= 30  # the finder did not silently match nothing
    assert any(t.mode == "full" for t in CHEAP) and any(t.mode == "excerpt" for t in CHEAP)


@pytest.mark.slow
@pytest.mark.parametrize("table", CHEAP, ids=lambda t: t.where)
def test_cheap_doc_table_matches_a_fresh_run(table: object) -> None:
    out, _, code = DT.run(table)
    assert code == 0, out[-5:]
    diff = DT.compare(table, out)
    assert not diff, "\n".join(diff)


def test_compare_full_and_excerpt() -> None:
    out = ["title", "a", "b", "c", "footer"]
    full = DT.Table(ROOT / "README.md", 1, [], out, "full", True, None, 0, 0)
    assert DT.compare(full, out) == []
    assert DT.compare(full, out[:-1]) != []
    excerpt = DT.Table(ROOT / "README.md", 1, [], ["a", "b  ", "...", "footer"], "excerpt", True,
                       None, 0, 0)
    assert DT.compare(excerpt, out) == []
    excerpt.shown = ["b", "a"]  # a part must appear contiguous and in order
    assert DT.compare(excerpt, out) != []
