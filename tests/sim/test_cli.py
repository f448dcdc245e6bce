"""``qosgate simulate`` end to end on a small scenario: tables, files, plots, overrides."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qosgate.cli import app
from tests.support.sim import SCENARIO

runner = CliRunner()


def _scenario(tmp_path: Path, text: str = SCENARIO) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


@pytest.mark.slow
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


@pytest.mark.slow
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


def test_empty_policies_and_a_class_typo_exit_2(tmp_path: Path) -> None:
    p = _scenario(tmp_path)
    for arg in ("", ",", " , "):
        res = runner.invoke(app, ["simulate", "--scenario", str(p), "--policies", arg])
        assert res.exit_code == 2, arg
        assert "--policies names no policy" in res.output
    typo = _scenario(tmp_path, SCENARIO.replace("class: batch", "class: bacth"))
    res = runner.invoke(app, ["simulate", "--scenario", str(typo), "--quiet"])
    assert res.exit_code == 2
    assert "Unknown QoS class 'bacth'" in res.output and "Traceback" not in res.output


def test_report_states_outcomes_and_what_goodput_counts(tmp_path: Path) -> None:
    res = runner.invoke(
        app, ["simulate", "--scenario", str(_scenario(tmp_path)), "--policies", "fifo,qos"]
    )
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "in each of the 2 run(s), every one of the" in text
    assert "requests had exactly one outcome" in text
    assert "count only requests that finished inside the arrival window" in text
    res = runner.invoke(
        app, ["simulate", "--scenario", str(_scenario(tmp_path)), "--policies", "qos",
              "--json-only"]
    )
    doc = json.loads(res.stdout)
    assert doc["one_outcome_each"] is True and doc["runs"][0]["one_outcome_each"] is True
    assert "inside the arrival window" in doc["definitions"]["goodput_rps"]
    totals = doc["runs"][0]["totals"]
    assert totals["goodput_rps_run"] is not None and totals["completed_rps_run"] is not None


def test_the_description_follows_load_and_duration(tmp_path: Path) -> None:
    text = SCENARIO.replace(
        "description: a small synthetic scenario for the determinism test",
        "description: gamma arrivals at {load} for {duration}",
    )
    p = _scenario(tmp_path, text)
    res = runner.invoke(
        app,
        ["simulate", "-s", str(p), "--policies", "fifo", "--duration", "4", "--json-only"],
    )
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["scenario"]["description"] == (
        "gamma arrivals at 14 req/s for 4 s"
    )


@pytest.mark.slow
def test_a_failing_heterogeneous_fleet_prints_replicas_faults_and_phases(
    tmp_path: Path,
) -> None:
    from tests.support.sim import FLEET

    p = _scenario(tmp_path, FLEET)
    out = tmp_path / "out"
    res = runner.invoke(
        app, ["simulate", "-s", str(p), "--policies", "fifo,qos", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "engines qwen2.5-7b-instruct-h100 x2 (window 16, not pausable) + " in text
    assert "qwen2.5-7b-instruct-a100 x1 (window 8, not pausable)" in text
    assert "faults: r0 dies at 5 s, restarted empty at 12 s; r2 steps x2.5 from 8 s" in text
    for title in ("per replica", "faults: attempts that failed", "by phase of the fleet"):
        assert title in text
    for phase in ("all up", "r0 down", "r0 down, r2 slow x2.5", "r2 slow x2.5"):
        assert phase in text
    rows = list(csv.DictReader((out / "det-fleet.csv").open()))
    assert {r["group"] for r in rows if r["group_kind"] == "replica"} == {"r0", "r1", "r2"}


@pytest.mark.slow
def test_queue_depth_plot_shares_one_y_scale_and_shows_realtime_ttft(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qosgate.sim import plots
    from qosgate.sim.scenario_file import load_scenario
    from qosgate.sim.scenarios import prepare, run_scenario

    res = run_scenario(prepare(load_scenario(_scenario(tmp_path))))
    figs: list[object] = []
    monkeypatch.setattr(plots.plt, "close", figs.append)
    plots.queue_depth(res, tmp_path / "q.png")
    (fig,) = figs
    axes = fig.axes  # type: ignore[attr-defined]
    assert len(axes) == len(res.runs) + 1  # one panel per policy, then realtime's TTFT
    ylims = {ax.get_ylim() for ax in axes[:-1]}
    assert len(ylims) == 1  # one y-scale for every policy
    assert "realtime: TTFT p99 over time" in axes[-1].get_title(loc="left")
    assert [line.get_label() for line in axes[-1].get_lines()][: len(res.runs)] == [
        r.policy for r in res.runs
    ]


def test_ttft_over_time_counts_the_unserved_as_infinitely_late() -> None:
    import math

    from qosgate.sim.plots import ttft_over_time
    from qosgate.sim.scenarios import Run
    from tests.support.sim import simulate

    # window 1: realtime requests queue behind each other; under fifo a long one blocks them
    reqs = [(0.0, "offline", 8, 2000)] + [(0.1 + 0.01 * i, "realtime", 8, 3) for i in range(5)]
    result = simulate(reqs, policy="fifo", window=1, duration=1.0)
    xs, ys = ttft_over_time(Run("fifo", None, 0.0, result, {}), "realtime", bins=2)
    assert xs == [0.25]  # every realtime request arrived in the first half
    assert ys[0] > 10 or math.isinf(ys[0])


@pytest.mark.slow
def test_router_and_tpot_guard_options_reach_the_config(tmp_path: Path) -> None:
    """The values go into the scenario's qosgate config: good ones run, bad ones are the
    config's own errors (exit 2, no traceback)."""
    p = _scenario(tmp_path)
    for args in (["--router", "least-load-spread"], ["--tpot-guard", "auto"],
                 ["--tpot-guard", "0.6"], ["--tpot-guard", "off"]):
        res = runner.invoke(app, ["simulate", "--scenario", str(p), "--policies", "qos",
                                  "--quiet", *args])
        assert res.exit_code == 0, (args, res.output)
    for args, field in ((["--router", "nearest"], "fleet.router"),
                        (["--tpot-guard", "sometimes"], "fleet.tpot_guard"),
                        (["--tpot-guard", "0"], "fleet.tpot_guard")):
        res = runner.invoke(app, ["simulate", "--scenario", str(p), "--quiet", *args])
        assert res.exit_code == 2, args
        assert field in res.output and "Traceback" not in res.output, res.output


@pytest.mark.slow
def test_prefill_budget_option_sets_the_budget(tmp_path: Path) -> None:
    """``--prefill-budget`` reaches the config: a budget of one token holds the other classes'
    prompts while realtime streams, so realtime's streams are steadier than without a budget
    (on prompts long enough for prefill to show in the engine's steps); bad values are the
    config's own errors (exit 2, no traceback)."""
    p = _scenario(tmp_path, SCENARIO.replace("mean: 600, cv: 1.2", "mean: 4000, cv: 0.5"))

    def realtime(*args: str) -> dict[str, float]:
        res = runner.invoke(app, ["simulate", "--scenario", str(p), "--policies", "qos",
                                  "--json-only", *args])
        assert res.exit_code == 0, (args, res.output)
        (run,) = json.loads(res.output)["runs"]
        rt: dict[str, float] = run["classes"]["realtime"]
        return rt

    off, tight = realtime("--prefill-budget", "off"), realtime("--prefill-budget", "1")
    assert tight["tpot_p90_ms"] < off["tpot_p90_ms"]
    from qosgate.config import Fleet

    default = Fleet.model_fields["prefill_budget_tokens"].default
    assert realtime() == realtime("--prefill-budget", str(default))  # the default, named
    for bad in ("0", "lots"):
        res = runner.invoke(app, ["simulate", "--scenario", str(p), "--quiet",
                                  "--prefill-budget", bad])
        assert res.exit_code == 2, bad
        assert "fleet.prefill_budget_tokens" in res.output and "Traceback" not in res.output


@pytest.mark.slow
def test_a_fault_scenario_cut_short_before_its_faults_prints_its_phases() -> None:
    # the arrival span ends before the scenario's first fault: some runs have a phase row,
    # some none, and the table lists what each has instead of failing on the missing one
    res = runner.invoke(app, ["simulate", "--scenario", "fleet-faults", "--duration", "30"])
    assert res.exit_code == 0, res.output
    assert "0-30 s" in res.output
