"""The scheduling guide's state diagram is the core's transition table, drawn
(``scripts/state_diagram.py``): a move added to or taken from ``TRANSITIONS`` fails here until
the guide is redrawn."""

from __future__ import annotations

from qosgate.core.request import TRANSITIONS
from tests.support.files import load_module

SD = load_module("scripts/state_diagram.py")


def test_the_guide_shows_the_diagram_of_the_transition_table() -> None:
    assert SD.main(["--check"]) == 0


def test_the_diagram_draws_every_move_once() -> None:
    drawn = [ln.strip() for ln in SD.mermaid() if "-->" in ln and "[*]" not in ln]
    assert len(drawn) == len(set(drawn)) == sum(len(t) for t in TRANSITIONS.values())
