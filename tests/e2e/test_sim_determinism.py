"""The simulator's same seed gives the same bytes in another process (another hash seed) and
through the CLI. (In this process, and another seed: ``tests/sim/test_determinism.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qosgate.cli import app
from tests.support.sim import FLEET, SCENARIO
from tests.support.sim import scenario_json as _json


@pytest.mark.e2e
@pytest.mark.parametrize("text", [SCENARIO, FLEET], ids=["det", "det-fleet"])
def test_same_bytes_in_another_process_and_through_the_cli(tmp_path: Path, text: str) -> None:
    p = tmp_path / "det.yaml"
    p.write_text(text)
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
