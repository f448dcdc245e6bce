"""``qosgate simulate`` end to end on a small scenario: tables, files, plots, overrides."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from typer.testing import CliRunner

from qosgate.cli import app
from tests.sim.test_determinism import SCENARIO

runner = CliRunner()


def _scenario(tmp_path: Path, text: str = SCENARIO) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


def test_table_files_and_plots(tmp_path: Path) -> None:
    p = _scenario(tmp_path)
    out = tmp_path / "out"
    res = runner.invoke(
        app, ["simulate", "--scenario", str(p), "--policies", "fifo,qos", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    assert "per class" in res.output and "realtime" in res.output
    doc = json.loads((out / "det.json").read_text())
    assert [r["policy"] for r in doc["runs"]] == ["fifo", "qos"]
    for run in doc["runs"]:
        assert run["lost"] == 0 and run["unfinished"] == 0
        assert sum(run["outcomes"].values()) == run["arrivals"]
    rows = list(csv.DictReader((out / "det.csv").open()))
    assert {r["group_kind"] for r in rows} >= {"total", "class", "tenant", "tier", "stream"}
    for name in ("det-ttft-cdf.png", "det-queue-depth.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_overrides_and_sweep_plot(tmp_path: Path) -> None:
    text = SCENARIO.replace("arrivals: {process: gamma, rate: 14, burstiness: 0.5}", "")
    text += "capacity_rps: 10\nsweep: {loads: [0.5, 1.5]}\narrivals: {process: poisson}\n"
    p = _scenario(tmp_path, text)
    out = tmp_path / "o"
    res = runner.invoke(
        app,
        [
            "simulate",
            "-s",
            str(p),
            "--policies",
            "qos",
            "--duration",
            "5",
            "--seed",
            "3",
            "--quiet",
            "--out",
            str(out),
        ],
    )
    assert res.exit_code == 0, res.output
    assert res.output == ""
    doc = json.loads((out / "det.json").read_text())
    assert doc["scenario"]["seed"] == 3 and doc["scenario"]["duration_s"] == 5
    assert [r["load"] for r in doc["runs"]] == [0.5, 1.5]
    assert (out / "det-latency-vs-load.png").exists()
    # --load replaces the sweep with one load
    res = runner.invoke(
        app,
        [
            "simulate",
            "-s",
            str(p),
            "--policies",
            "fifo",
            "--duration",
            "5",
            "--load",
            "0.8",
            "--json-only",
        ],
    )
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [r["load"] for r in doc["runs"]] == [0.8]


def test_errors_exit_2(tmp_path: Path) -> None:
    res = runner.invoke(app, ["simulate", "--scenario", "nope"])
    assert res.exit_code == 2
    res = runner.invoke(
        app, ["simulate", "--scenario", str(_scenario(tmp_path)), "--policies", "lottery"]
    )
    assert res.exit_code == 2


def test_list() -> None:
    res = runner.invoke(app, ["simulate", "--list"])
    assert res.exit_code == 0
    assert "seed-classes" in res.output and "tenants" in res.output
