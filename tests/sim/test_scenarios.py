"""Scenarios: the built-ins load and run, overrides re-validate, errors are readable; and the
issue's claims on short runs of the real scenarios."""

from __future__ import annotations

from pathlib import Path

import pytest

from qosgate.models.simmodel import load_profile
from qosgate.sim.capacity import saturation_throughput
from qosgate.sim.report import ledger_ok
from qosgate.sim.scenario_file import (
    ScenarioError,
    available_scenarios,
    describe,
    load_scenario,
    override,
    scenario_from_mapping,
)
from qosgate.sim.scenarios import attribution, prepare, run_scenario
from qosgate.sim.workload import TRACE_ATTRIBUTION, TRACE_NAME, find_trace, sample_lengths

BUILTIN = ("azure-conv", "fleet-faults", "fleet-mixed", "load-sweep", "models-heavy-light",
           "seed-classes", "tenants")


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
@needs_trace
def test_tenants_short_run_is_fair_under_qos() -> None:
    s = override(load_scenario("tenants"), duration_s=90.0, policies=["fifo", "qos"])
    res = run_scenario(prepare(s))
    by = {r.policy: r.metrics for r in res.runs}
    assert by["qos"]["fairness"]["medium"]["jain"] >= 0.95
    assert by["qos"]["fairness"]["medium"]["jain"] > by["fifo"]["fairness"]["medium"]["jain"]


SLOS = {"realtime": 100, "api": 100, "batch": 1000, "offline": 1000}
CONST = {
    "prompt": {"dist": "constant", "value": 900},
    "output": {"dist": "constant", "value": 100},
}


def small(**fields: object) -> dict[str, object]:
    base: dict[str, object] = {
        "name": "s",
        "duration_s": 5,
        "arrivals": {"rate": 2},
        "mix": [{"share": 1, "class": "api"}],
        "lengths": CONST,
        "tpot_slo_ms": SLOS,
    }
    base.update(fields)
    return base


def test_replicas_as_a_count_is_unchanged() -> None:
    prep = prepare(scenario_from_mapping(small(replicas=3, window=16)))
    assert [p.name for p in prep.fleet] == ["r0", "r1", "r2"]
    assert {p.profile.name for p in prep.fleet} == {"qwen2.5-7b-instruct-h100"}
    assert {(p.window, p.pausable) for p in prep.fleet} == {(16, True)}
    assert prep.uniform and prep.window == 16


def test_heterogeneous_fleet_windows_and_capacity() -> None:
    s = scenario_from_mapping(
        small(
            replicas=[
                {"count": 2},  # the scenario's profile
                {"profile": "qwen2.5-7b-instruct-a100", "window": 32, "pausable": False},
            ],
            arrivals={"load": 1.0},
            profile_overrides={"kv_capacity_tokens": 50_000},
        )
    )
    prep = prepare(s)
    assert [p.name for p in prep.fleet] == ["r0", "r1", "r2"]
    h100, a100 = prep.fleet[0], prep.fleet[2]
    assert h100.profile.name == "qwen2.5-7b-instruct-h100"
    assert h100.profile.kv_capacity_tokens == 50_000  # the scenario's overrides apply
    assert h100.window == 50  # auto: 50,000 KV tokens / 1,000 per request
    assert (a100.profile.name, a100.window, a100.pausable) == (
        "qwen2.5-7b-instruct-a100",
        32,
        False,
    )
    # the scenario's overrides go with its own profile, not with a group's other one
    assert a100.profile == load_profile("qwen2.5-7b-instruct-a100")
    assert not prep.uniform
    # the capacity is each replica's own, summed
    lengths = sample_lengths(s.mix, s.lengths, None, s.seed, 4000)
    each = saturation_throughput(h100.profile, 50, lengths, s.max_tokens)
    other = saturation_throughput(a100.profile, 32, lengths, s.max_tokens)
    assert prep.capacity_rps == pytest.approx(2 * each + other)
    assert "x2" in prep.fleet_text() and "not pausable" in prep.fleet_text()


def test_fleet_and_fault_errors() -> None:
    with pytest.raises(ScenarioError, match="a slow fault needs a factor"):
        scenario_from_mapping(small(faults=[{"replica": 0, "kind": "slow", "at_s": 1}]))
    with pytest.raises(ScenarioError, match="until_s must be after at_s"):
        scenario_from_mapping(
            small(faults=[{"replica": 0, "kind": "die", "at_s": 2, "until_s": 1}])
        )
    with pytest.raises(ScenarioError, match="overlapping die faults"):
        scenario_from_mapping(
            small(
                faults=[
                    {"replica": "r0", "kind": "die", "at_s": 1, "until_s": 5},
                    {"replica": 0, "kind": "die", "at_s": 3},
                ]
            )
        )
    s = scenario_from_mapping(
        small(replicas=2, faults=[{"replica": "r2", "kind": "die", "at_s": 1}])
    )
    with pytest.raises(ScenarioError, match="fault on replica r2, but the fleet has r0, r1"):
        prepare(s)
    mixed = scenario_from_mapping(small(replicas=[{"count": 1}]))
    with pytest.raises(ScenarioError, match="lists its replicas"):
        override(mixed, replicas=3)
    with pytest.raises(ScenarioError, match="at least 1 item"):
        scenario_from_mapping(small(policies=[]))


def test_a_class_typo_is_an_error_when_the_scenario_is_prepared() -> None:
    s = scenario_from_mapping(small(mix=[{"share": 1, "class": "realtme"}]))
    with pytest.raises(ScenarioError, match=r"mix\[0\] \(realtme\): Unknown QoS class 'realtme'"):
        prepare(s)
    s = scenario_from_mapping(small(mix=[{"share": 1, "tenant": "nobody"}]))
    with pytest.raises(ScenarioError, match="tenant 'nobody' is not in the config"):
        prepare(s)
    s = scenario_from_mapping(small(mix=[{"share": 1, "task_type": "dance"}]))
    with pytest.raises(ScenarioError, match="dance"):
        prepare(s)


def test_the_description_follows_the_overrides() -> None:
    sc = load_scenario("seed-classes")
    assert "offered at 2x the engine's capacity" in describe(sc)
    assert "offered at 3x the engine's capacity" in describe(override(sc, arrivals={"load": 3}))
    az = load_scenario("azure-conv")
    assert "replayed 3x faster" in describe(az)
    assert "replayed 5x faster" in describe(override(az, arrivals={"time_scale": 5}))
    sweep = load_scenario("load-sweep")
    assert "Offered load 50-150% of capacity" in describe(sweep)
    one = override(sweep, arrivals={"load": 1.1, "rate": None}, sweep=None)
    assert "Offered load 1.1x of capacity" in describe(one)
    # a description with no placeholder gets a note of what the run uses instead
    plain = scenario_from_mapping(small(description="two requests a second"))
    assert describe(override(plain, arrivals={"rate": 5})) == "two requests a second"  # no {load}
    loaded = scenario_from_mapping(
        small(description="at 1x", arrivals={"load": 1.0}, capacity_rps=10)
    )
    assert describe(override(loaded, arrivals={"load": 4})) == "at 1x [overridden: load 4x]"
    assert describe(override(loaded, duration_s=9)) == "at 1x [overridden: duration 9 s]"


@needs_trace
def test_attribution_follows_the_trace_that_was_read(tmp_path: Path) -> None:
    assert attribution(prepare(override(load_scenario("seed-classes"), capacity_rps=20))) == (
        TRACE_ATTRIBUTION
    )
    # another trace: credited by its own name, not as the Azure trace
    rows = find_trace(TRACE_NAME).read_text().splitlines()[:200]
    mine = tmp_path / "my_trace.csv"
    mine.write_text("\n".join(rows) + "\n")
    prep = prepare(override(load_scenario("azure-conv"), capacity_rps=20), mine)
    note = attribution(prep)
    assert note is not None and "my_trace.csv" in note and "Azure" not in note
    # a scenario that reads no trace credits none, and a --trace it would not use is an error
    plain = scenario_from_mapping(small())
    assert attribution(prepare(plain)) is None
    with pytest.raises(ScenarioError, match="draws nothing from a trace"):
        prepare(plain, mine)


@pytest.mark.slow
@needs_trace
def test_fleet_faults_short_run_accounts_every_request() -> None:
    # the shipped scenario with its faults compressed into a 30 s window
    s = override(
        load_scenario("fleet-faults"),
        duration_s=30.0,
        policies=["fifo", "qos"],
        faults=[
            {"replica": "r0", "kind": "die", "at_s": 10, "until_s": 20},
            {"replica": "r1", "kind": "slow", "at_s": 15, "factor": 3},
        ],
    )
    res = run_scenario(prepare(s))
    assert ledger_ok(res)
    for run in res.runs:
        recs = run.result.records
        fleet = run.result.fleet
        failed = [r for r in recs if r.state == "failed"]
        # a request fails only by r0's death: never started after attempts that failed (on
        # r0) beyond its attempts or the retry budget; the streams cut on r0 went on elsewhere
        cold = [r for r in failed if r.first_token_at is None]
        assert not [r for r in failed if r.first_token_at is not None]
        assert run.result.moves > 0
        assert all(r.failed_attempts >= 1 and r.reason.startswith("upstream_") for r in cold)
        # the core's ledger of attempts agrees: every failed attempt was retried, or ended its
        # request (failed, never started)
        fails, retries = fleet["attempt_failures"], fleet["retries"]
        assert isinstance(fails, dict) and isinstance(retries, dict)
        assert sum(fails.values()) - sum(retries.values()) - run.result.moves == len(cold)
        assert sum(retries.values()) > 0
        assert [p["fleet"] for p in run.metrics["phases"]] == [
            "all up",
            "r0 down",
            "r0 down, r1 slow x3",
            "r1 slow x3",
        ]
        assert run.result.fleet["faults"] == [
            {"t": 10.0, "replica": "r0", "action": "die"},
            {"t": 15.0, "replica": "r1", "action": "slow", "factor": 3.0},
            {"t": 20.0, "replica": "r0", "action": "revive"},
        ]
