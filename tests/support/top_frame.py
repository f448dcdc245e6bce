"""Reading ``qosgate top``'s frame as text: the unit tests' canned frames and the e2e tests'
``top --once`` output name their cells the same way."""

from __future__ import annotations


def row(frame_text: str, section: str, first: str) -> list[str]:
    """The cells of the row named ``first`` in the table titled ``section``."""
    lines = frame_text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith(section))
    for ln in lines[start + 1:]:
        cells = ln.split()
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} under {section!r}:\n{frame_text}")
