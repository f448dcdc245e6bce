"""Scenarios: the built-ins load and run, overrides re-validate, errors are readable; and the
issue's claims on short runs of the real scenarios."""

from __future__ import annotations

from pathlib import Path

import pytest

from qosgate.sim.report import ledger_ok
from qosgate.sim.scenarios import (
    ScenarioError,
    available_scenarios,
    load_scenario,
    override,
    prepare,
    run_scenario,
    scenario_from_mapping,
)
from qosgate.sim.workload import TRACE_NAME, find_trace

BUILTIN = ("azure-conv", "load-sweep", "seed-classes", "tenants")


def have_trace() -> bool:
    try:
        find_trace(TRACE_NAME)
    except FileNotFoundError:
        return False
    return True


needs_trace = pytest.mark.skipif(not have_trace(), reason="shared/traces not found")


def test_builtins_are_listed_and_valid() -> None:
    assert set(BUILTIN) <= set(available_scenarios())
    for name in BUILTIN:
        s = load_scenario(name)
        assert s.name == name
        assert s.description


@needs_trace
@pytest.mark.parametrize("name", BUILTIN)
def test_builtins_run_briefly(name: str) -> None:
    s = override(load_scenario(name), duration_s=3.0, capacity_rps=20.0, policies=["fifo", "qos"])
    if s.sweep:
        s = override(s, sweep={"loads": [0.5, 1.5]})
    prep = prepare(s)
    res = run_scenario(prep)
    assert ledger_ok(res)
    assert len(res.runs) == (2 if not s.sweep else 4)


def test_load_by_path_and_errors(tmp_path: Path) -> None:
    p = tmp_path / "mine.yaml"
    p.write_text(
        "name: mine\nduration_s: 5\narrivals: {rate: 3}\nmix: [{share: 1, class: api}]\n"
        "tpot_slo_ms: {realtime: 100, api: 100, batch: 1000, offline: 1000}\n"
    )
    s = load_scenario(p)
    assert s.name == "mine" and s.arrivals.rate == 3
    with pytest.raises(ScenarioError, match="unknown scenario"):
        load_scenario("no-such-scenario")
    with pytest.raises(ScenarioError, match="unknown policy"):
        scenario_from_mapping({"name": "x", "mix": [{"share": 1}], "policies": ["lottery"]})
    with pytest.raises(ScenarioError, match=r"rate or arrivals\.load, not both"):
        scenario_from_mapping(
            {"name": "x", "mix": [{"share": 1}], "arrivals": {"rate": 1, "load": 1}}
        )
    bad = override(s, tpot_slo_ms={"api": 100})
    with pytest.raises(ScenarioError, match="tpot_slo_ms has no SLO"):
        prepare(bad)


def test_window_auto_follows_kv_and_max_num_seqs(tmp_path: Path) -> None:
    s = scenario_from_mapping(
        {
            "name": "w",
            "duration_s": 5,
            "arrivals": {"rate": 1},
            "mix": [{"share": 1, "class": "api"}],
            "lengths": {
                "prompt": {"dist": "constant", "value": 900},
                "output": {"dist": "constant", "value": 100},
            },
            "tpot_slo_ms": {"realtime": 1, "api": 1, "batch": 1, "offline": 1},
            "profile_overrides": {"kv_capacity_tokens": 50_000},
        }
    )
    prep = prepare(s)
    assert prep.mean_tokens == 1000
    assert prep.window == 50  # 50,000 KV tokens / 1,000 tokens per request < max_num_seqs
    assert prepare(override(s, window=7)).window == 7
    assert prep.capacity_rps is None  # a rate needs no capacity measurement


@needs_trace
def test_seed_classes_short_run_keeps_realtime_within_slo() -> None:
    s = override(load_scenario("seed-classes"), duration_s=60.0, policies=["fifo", "qos"])
    res = run_scenario(prepare(s))
    assert ledger_ok(res)
    by = {r.policy: r.metrics for r in res.runs}
    slo_ms = res.prep.slos["realtime"].ttft_s * 1000
    assert by["qos"]["classes"]["realtime"]["ttft_p99_ms"] <= slo_ms
    fifo_rt = by["fifo"]["classes"]["realtime"]
    assert fifo_rt["timed_out"] > 0 or fifo_rt["ttft_p99_ms"] > slo_ms


@needs_trace
def test_tenants_short_run_is_fair_under_qos() -> None:
    s = override(load_scenario("tenants"), duration_s=90.0, policies=["fifo", "qos"])
    res = run_scenario(prepare(s))
    by = {r.policy: r.metrics for r in res.runs}
    assert by["qos"]["fairness"]["medium"]["jain"] >= 0.95
    assert by["qos"]["fairness"]["medium"]["jain"] > by["fifo"]["fairness"]["medium"]["jain"]
