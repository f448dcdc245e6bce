"""``window_mode`` / ``--window-mode``: the simulator's replicas with the core's adaptive window
(the scenario's window its ceiling). It moves during a run, the report shows it, and the same
seed still gives the same bytes; unset, a pausable replica keeps its fixed window."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from qosgate.cli import app
from qosgate.sim.report import document, dumps
from qosgate.sim.scenario_file import ScenarioError, load_scenario, override
from qosgate.sim.scenarios import prepare, run_scenario
from tests.support.sim import SCENARIO

# overloaded, with room for the adaptive window to move below its ceiling of 256
ADAPTIVE = (
    SCENARIO.replace("name: det", "name: det-adaptive")
    .replace("window: 32", "window: 256\nwindow_mode: adaptive")
    .replace("policies: [fifo, qos, engine-priority]", "policies: [qos, engine-priority]")
    .replace("rate: 14", "rate: 40")
)


def _write(tmp_path: Path, text: str, name: str = "adaptive.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _doc(path: Path, **changes: Any) -> str:
    s = load_scenario(path)
    if changes:
        s = override(s, **changes)
    return dumps(document(run_scenario(prepare(s))))


def _run(doc: dict[str, Any], policy: str) -> dict[str, Any]:
    return next(r for r in doc["runs"] if r["policy"] == policy)


@pytest.mark.slow
def test_adaptive_window_moves_and_stays_deterministic(tmp_path: Path) -> None:
    p = _write(tmp_path, ADAPTIVE)
    text = _doc(p)
    assert text == _doc(p)
    doc = json.loads(text)
    assert doc["one_outcome_each"] is True
    qos = _run(doc, "qos")
    rep = qos["replicas"]["r0"]
    assert rep["window"] == 256  # the ceiling
    assert qos["fleet"]["replicas"][0]["window_mode"] == "adaptive"
    assert rep["window_mean"] is not None and rep["window_mean"] < 255.5
    series = [w for w in qos["timeseries"]["windows"]["r0"] if w is not None]
    assert len(set(series)) > 1  # it moved during the run
    assert max(series) <= 256
    # engine-priority passes everything through, whatever the mode
    assert _run(doc, "engine-priority")["fleet"]["replicas"][0]["window_mode"] is None


@pytest.mark.slow
def test_fixed_by_default_and_by_override(tmp_path: Path) -> None:
    p = _write(tmp_path, ADAPTIVE.replace("window_mode: adaptive\n", ""))
    for text in (_doc(p), _doc(p, window_mode="fixed")):
        qos = _run(json.loads(text), "qos")
        assert set(w for w in qos["timeseries"]["windows"]["r0"] if w is not None) == {256}
        assert qos["replicas"]["r0"]["window_mean"] == 256
    # unset and fixed give the same runs (a pausable replica's default window is fixed)
    assert _run(json.loads(_doc(p)), "qos")["totals"] == _run(
        json.loads(_doc(p, window_mode="fixed")), "qos"
    )["totals"]


@pytest.mark.slow
def test_cli_window_mode(tmp_path: Path) -> None:
    p = _write(tmp_path, ADAPTIVE.replace("window_mode: adaptive\n", ""), "unset.yaml")
    out = CliRunner().invoke(
        app, ["simulate", "--scenario", str(p), "--window-mode", "adaptive", "--json-only"]
    )
    assert out.exit_code == 0, out.output
    assert out.stdout == _doc(_write(tmp_path, ADAPTIVE))
    shown = CliRunner().invoke(
        app, ["simulate", "--scenario", str(p), "--window-mode", "adaptive", "--no-plots"]
    )
    assert shown.exit_code == 0, shown.output
    assert "window mode adaptive" in shown.stdout
    assert "per replica" in shown.stdout  # the window is shown, one replica or many
    bad = CliRunner().invoke(app, ["simulate", "--scenario", str(p), "--window-mode", "elastic"])
    assert bad.exit_code == 2


def test_bad_window_mode_in_a_scenario(tmp_path: Path) -> None:
    p = _write(tmp_path, ADAPTIVE.replace("window_mode: adaptive", "window_mode: elastic"))
    try:
        load_scenario(p)
    except (ScenarioError, ValueError):
        return
    raise AssertionError("window_mode: elastic was accepted")
