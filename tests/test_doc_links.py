"""Links between the docs resolve: every relative link in README.md and docs/ names a file that
exists and, where it names a heading (``#anchor``), a heading that file has (anchors as GitHub
makes them from a heading's text)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(`{3,}|~{3,})")


def _prose(path: Path) -> list[str]:
    """The file's lines outside fenced blocks (a console block's brackets are no links)."""
    lines, fence = [], ""
    for line in path.read_text().split("\n"):
        m = FENCE.match(line)
        if m and (not fence or m.group(1).startswith(fence)):
            fence = "" if fence else m.group(1)[:3]
        elif not fence:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's anchor for each heading: lower case, punctuation dropped, spaces to hyphens, a
    repeated one numbered."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose(path):
        if not line.startswith("#"):
            continue
        text = line.lstrip("#").strip()
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(path: Path) -> list[str]:
    return [m.group(1) for line in _prose(path) for m in LINK.finditer(line)
            if not re.match(r"[a-z]+:", m.group(1))]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_in_the_doc_resolves(doc: Path) -> None:
    broken = []
    for target in links(doc):
        file, _, anchor = target.partition("#")
        dest = (doc.parent / file).resolve() if file else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no such heading")
    assert not broken, "\n".join(broken)
