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
from qosgate.sim.report import document, dumps
from qosgate.sim.scenario_file import load_scenario, override
from qosgate.sim.scenarios import prepare, run_scenario

SCENARIO = """
name: det
description: a small synthetic scenario for the determinism test
profile: qwen2.5-7b-instruct-h100
window: 32
policies: [fifo, qos, engine-priority]
seed: 11
duration_s: 20
arrivals: {process: gamma, rate: 14, burstiness: 0.5}
lengths:
  prompt: {dist: lognormal, mean: 600, cv: 1.2, max: 8000}
  output: {dist: lognormal, mean: 150, cv: 1.0, max: 1500}
mix:
  - {share: 2, class: realtime}
  - {share: 3, class: api}
  - {share: 3, class: batch}
  - {share: 2, class: offline}
tpot_slo_ms: {realtime: 100, api: 150, batch: 1000, offline: 1000}
"""


# a heterogeneous fleet of upstream-like replicas, one dying and coming back, one slowed
FLEET = (
    SCENARIO.replace("name: det", "name: det-fleet")
    .replace("window: 32", "window: 16\npausable: false\nprobe_interval_s: 0.5")
    .replace(
        "profile: qwen2.5-7b-instruct-h100",
        "profile: qwen2.5-7b-instruct-h100\n"
        "replicas:\n"
        "  - {count: 2}\n"
        "  - {profile: qwen2.5-7b-instruct-a100, window: 8}\n"
        "faults:\n"
        "  - {replica: r0, kind: die, at_s: 5, until_s: 12}\n"
        "  - {replica: r2, kind: slow, at_s: 8, factor: 2.5}",
    )
    .replace("rate: 14", "rate: 30")
)


def _write(tmp_path: Path, text: str = SCENARIO) -> Path:
    p = tmp_path / "det.yaml"
    p.write_text(text)
    return p


def _json(path: Path, seed: int | None = None) -> str:
    s = load_scenario(path)
    if seed is not None:
        s = override(s, seed=seed)
    return dumps(document(run_scenario(prepare(s))))


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


@pytest.mark.parametrize("text", [SCENARIO, FLEET], ids=["det", "det-fleet"])
def test_same_bytes_in_another_process_and_through_the_cli(tmp_path: Path, text: str) -> None:
    p = _write(tmp_path, text)
    here = _json(p)
    code = (
        "import sys; from pathlib import Path; from tests.sim.test_determinism import _json; "
        "sys.stdout.write(_json(Path(sys.argv[1])))"
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
