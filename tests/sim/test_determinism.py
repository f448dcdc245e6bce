"""Same seed -> byte-identical JSON, in this process, in another one (other hash seed) and through
the CLI; another seed -> another document."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qosgate.cli import app
from tests.support.sim import FLEET, SCENARIO
from tests.support.sim import scenario_json as _json


def _write(tmp_path: Path, text: str = SCENARIO) -> Path:
    p = tmp_path / "det.yaml"
    p.write_text(text)
    return p


def test_same_seed_same_bytes(tmp_path: Path) -> None:
    p = _write(tmp_path)
    a = _json(p)
    assert a == _json(p)
    assert a != _json(p, seed=12)


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


@pytest.mark.e2e
@pytest.mark.parametrize("text", [SCENARIO, FLEET], ids=["det", "det-fleet"])
def test_same_bytes_in_another_process_and_through_the_cli(tmp_path: Path, text: str) -> None:
    p = _write(tmp_path, text)
    here = _json(p)
    code = (
        "import sys; from pathlib import Path; from tests.support.sim import scenario_json; "
        "sys.stdout.write(scenario_json(Path(sys.argv[1])))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    root = Path(__file__).resolve().parents[2]
    other = subprocess.run(
        [sys.executable, "-c", code, str(p)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=root,
    ).stdout
    assert other == here
    out = CliRunner().invoke(app, ["simulate", "--scenario", str(p), "--json-only"])
    assert out.exit_code == 0, out.output
    assert out.stdout == here
