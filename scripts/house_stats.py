"""Print the shape of the source tree: lines per folder, modules over 500 lines, the longest
functions, and the size of the Markdown docs.

Why a script: a layout review compares these figures before and after a change; printing them
from the tree itself keeps the comparison honest and re-runnable (``python scripts/house_stats.py
[ROOT]``, where ROOT is a checkout, the current one by default).
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from pathlib import Path

LONG_MODULE = 500
LONGEST = 15


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def _functions(path: Path, root: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno:
            length = node.end_lineno - node.lineno + 1
            found.append((length, f"{path.relative_to(root)}::{node.name}"))
    return found


def main(root: Path) -> None:
    src = root / "src" / "qosgate"
    modules = sorted(p for p in src.rglob("*.py") if "__pycache__" not in p.parts)
    per_folder: Counter[str] = Counter()
    files_per_folder: Counter[str] = Counter()
    for p in modules:
        folder = str(p.parent.relative_to(src)) or "."
        per_folder[folder] += _lines(p)
        files_per_folder[folder] += 1
    print(f"## src/qosgate: {sum(per_folder.values())} lines in {len(modules)} modules")
    print("| folder | modules | lines |\n|---|---:|---:|")
    for folder in sorted(per_folder):
        print(f"| {folder} | {files_per_folder[folder]} | {per_folder[folder]} |")

    big = sorted(((_lines(p), p) for p in modules), reverse=True)
    print(f"\n## modules over {LONG_MODULE} lines")
    for n, p in big:
        if n > LONG_MODULE:
            print(f"- {p.relative_to(root)}: {n}")

    funcs = sorted((f for p in modules for f in _functions(p, root)), reverse=True)
    print(f"\n## the {LONGEST} longest functions")
    for n, name in funcs[:LONGEST]:
        print(f"- {name}: {n}")

    tests = root / "tests"
    test_files = [p for p in tests.rglob("test_*.py") if "__pycache__" not in p.parts]
    per_test_folder = Counter(str(p.parent.relative_to(tests)) for p in test_files)
    print(f"\n## tests: {len(test_files)} files")
    print(", ".join(f"{k} {v}" for k, v in sorted(per_test_folder.items())))

    docs = root / "docs"
    sizes: Counter[str] = Counter()
    for p in docs.rglob("*.md"):
        part = p.relative_to(docs).parts
        sizes[part[0] if len(part) > 1 else "."] += p.stat().st_size
    total = sum(sizes.values())
    print(f"\n## docs: {total / 1024:.0f} KB of Markdown")
    for k, v in sorted(sizes.items()):
        print(f"- {k}: {v / 1024:.0f} KB ({100 * v / total:.0f}%)")
    largest = sorted(((p.stat().st_size, p) for p in docs.rglob("*.md")), reverse=True)[:5]
    print("- largest: " + ", ".join(f"{p.relative_to(docs)} {s / 1024:.0f} KB" for s, p in largest))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
