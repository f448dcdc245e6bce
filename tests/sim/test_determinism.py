"""Same seed -> byte-identical JSON in this process; another seed -> another document. (In another
process and through the CLI: ``tests/e2e/test_sim_determinism.py``.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.sim import FLEET, SCENARIO
from tests.support.sim import scenario_json as _json


def _write(tmp_path: Path, text: str = SCENARIO) -> Path:
    p = tmp_path / "det.yaml"
    p.write_text(text)
    return p


@pytest.mark.slow
def test_same_seed_same_bytes(tmp_path: Path) -> None:
    p = _write(tmp_path)
    a = _json(p)
    assert a == _json(p)
    assert a != _json(p, seed=12)


@pytest.mark.slow
def test_same_seed_same_bytes_with_a_failing_heterogeneous_fleet(tmp_path: Path) -> None:
    p = _write(tmp_path, FLEET)
    a = _json(p)
    assert a == _json(p)
    doc = json.loads(a)
    assert [r["profile"] for r in doc["scenario"]["fleet"]] == [
        "qwen2.5-7b-instruct-h100",
        "qwen2.5-7b-instruct-h100",
        "qwen2.5-7b-instruct-a100",
    ]
    assert doc["one_outcome_each"] is True
    assert all(sum(r["fleet"]["attempt_failures"].values()) for r in doc["runs"])
    assert a != _json(p, seed=12)


