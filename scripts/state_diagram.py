#!/usr/bin/env python3
"""Draw the request's state diagram from the core's transition table, into the scheduling guide.

The diagram a user reads is the table ``Request.move`` enforces (``TRANSITIONS`` in
``qosgate.core.request``), never a drawing kept by hand: this writes it as a Mermaid
``stateDiagram-v2`` block between two markers in docs/guides/scheduling.md, and ``--check``
fails when the guide's block differs from the table (tests/test_state_diagram.py runs it)::

    python scripts/state_diagram.py            # rewrite the block in the guide
    python scripts/state_diagram.py --check    # exit 1 if the guide's block is out of date
    python scripts/state_diagram.py --dot FILE # also write the diagram as Graphviz DOT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from qosgate.core.request import TERMINAL, TRANSITIONS, State  # noqa: E402

GUIDE = ROOT / "docs" / "guides" / "scheduling.md"
BEGIN = "<!-- state-diagram: begin (scripts/state_diagram.py writes this block) -->"
END = "<!-- state-diagram: end -->"


def moves() -> list[tuple[State, State]]:
    """Every legal move, in the order the states are declared (a stable drawing)."""
    order = list(State)
    return [(a, b) for a in order for b in order if b in TRANSITIONS[a]]


def mermaid() -> list[str]:
    lines = ["```mermaid", "stateDiagram-v2", f"    [*] --> {State.NEW.value}"]
    lines += [f"    {a.value} --> {b.value}" for a, b in moves()]
    lines += [f"    {s.value} --> [*]" for s in State if s in TERMINAL]
    return [*lines, "```"]


def dot() -> str:
    lines = ["digraph request_states {", "    rankdir=LR;"]
    lines += [f"    {s.value} [shape={'doublecircle' if s in TERMINAL else 'circle'}];"
              for s in State]
    lines += [f"    {a.value} -> {b.value};" for a, b in moves()]
    return "\n".join([*lines, "}"]) + "\n"


def with_diagram(text: str) -> str:
    """``text`` with the block between the markers replaced by the current diagram."""
    lines = text.split("\n")
    try:
        start, end = lines.index(BEGIN), lines.index(END)
    except ValueError:
        raise SystemExit(
            f"{GUIDE.relative_to(ROOT)}: the state-diagram markers are missing") from None
    return "\n".join([*lines[:start + 1], *mermaid(), *lines[end:]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the guide's diagram differs from the transition table")
    ap.add_argument("--dot", type=Path, metavar="FILE", help="also write the diagram as DOT")
    args = ap.parse_args(argv)
    text = GUIDE.read_text()
    fresh = with_diagram(text)
    if args.dot:
        args.dot.write_text(dot())
    if args.check:
        if fresh != text:
            print(f"{GUIDE.relative_to(ROOT)}: the state diagram differs from "
                  "qosgate.core.request.TRANSITIONS; run scripts/state_diagram.py", flush=True)
            return 1
        print("the state diagram matches the transition table")
        return 0
    if fresh != text:
        GUIDE.write_text(fresh)
        print(f"wrote the state diagram into {GUIDE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
