"""Several models in the simulator: requests carry their model to the replicas that serve it,
each tenant's engine time adds up to the replicas' busy time, the models' profiles set their
weights, and the scenario file checks what it is given."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.config import config_from_mapping
from qosgate.core import QosInputs
from qosgate.sim.driver import Simulation, run_policy
from qosgate.sim.report import document
from qosgate.sim.scenario_file import ScenarioError, load_scenario, override, scenario_from_mapping
from qosgate.sim.scenarios import prepare, run_scenario, setup_for, workload_for
from qosgate.sim.setup import ReplicaPlan, SimSetup
from qosgate.sim.workload import Arrival, Stream, Workload
from tests.support.sim import TOY, toy

# every time coefficient of TOY x 10
HEAVY = toy(step_fixed_s=0.1, prefill_s_per_token=0.01, decode_s_per_seq=0.02)
TENANTS = ("ta", "tb")
CFG = config_from_mapping({"tenants": [{"name": t, "api_keys": [f"key-{t}"]} for t in TENANTS]})


def _workload(reqs: list[tuple[float, int, int, int]], models: tuple[str, ...]) -> Workload:
    """``reqs``: (arrival, stream, prompt, output); stream k is tenant k % 2 on model k // 2."""
    streams = tuple(
        Stream.model_validate({"share": 1, "class": "api", "tenant": TENANTS[k % 2],
                               "model": models[k // 2]})
        for k in range(2 * len(models)))
    inputs = tuple(QosInputs(api_key=f"key-{s.tenant}", qos_class="api") for s in streams)
    arrivals = tuple(Arrival(t, f"r{i:04d}", k, p, o, o)
                     for i, (t, k, p, o) in enumerate(sorted(reqs)))
    end = max(t for t, *_ in reqs) + 1e-9
    return Workload(arrivals, streams, inputs, end, len(arrivals) / end)


def _setup(reqs: list[tuple[float, int, int, int]], served: tuple[tuple[str, ...], ...],
           window: int = 2) -> SimSetup:
    profiles = {"light": TOY, "heavy": HEAVY}
    fleet = tuple(
        ReplicaPlan(f"r{i}", TOY, window, models=models,
                    model_profiles=tuple((m, profiles[m]) for m in models))
        for i, models in enumerate(served))
    return SimSetup(cfg=CFG, profile=TOY, replicas=len(fleet), window=window,
                    workload=_workload(reqs, ("light", "heavy")), sample_interval=0.5,
                    fleet=fleet)


def test_a_request_runs_only_where_its_model_is_served() -> None:
    reqs = [(0.01 * i, i % 4, 20, 5) for i in range(20)]
    res = run_policy(_setup(reqs, (("heavy",), ("light",))), "qos")
    assert all(r.state == "completed" for r in res.records)
    for r in res.records:
        model = ("light", "heavy")[r.stream // 2]
        assert r.replica == ("r0" if model == "heavy" else "r1")


def test_shared_replicas_charge_each_model_s_pass_to_its_own_tenant() -> None:
    # one request each, together on one replica: the heavy one's pass is ten times the light's
    reqs = [(0.0, 0, 10, 3), (0.0, 3, 10, 3)]  # ta on light, tb on heavy
    res = run_policy(_setup(reqs, (("heavy", "light"),)), "qos")
    api = res.engine_time["api"]
    light = api["ta"]["prefill_s"] + api["ta"]["decode_s"]
    heavy = api["tb"]["prefill_s"] + api["tb"]["decode_s"]
    assert heavy == pytest.approx(10 * light)
    assert light + heavy == pytest.approx(res.engine["busy_s"])


REQS = st.lists(st.tuples(st.floats(0, 3), st.integers(0, 3), st.integers(1, 80),
                          st.integers(1, 30)), min_size=2, max_size=25)
FLEETS = st.sampled_from([(("heavy", "light"),), (("heavy",), ("light",)),
                          (("heavy", "light"), ("light",)), (("heavy", "light"),) * 2])


@settings(derandomize=True, max_examples=30, deadline=None)
@given(REQS, FLEETS, st.integers(1, 4))
def test_the_tenants_engine_time_adds_up_to_the_replicas_busy_time(
        reqs: list[tuple[float, int, int, int]], served: tuple[tuple[str, ...], ...],
        window: int) -> None:
    res = run_policy(_setup(reqs, served, window), "qos")
    charged = math.fsum(t["prefill_s"] + t["decode_s"]
                        for tenants in res.engine_time.values() for t in tenants.values())
    assert charged == pytest.approx(res.engine["busy_s"], rel=1e-9, abs=1e-12)
    assert len(res.records) == len(reqs) and res.unfinished == 0


def test_the_scenario_s_models_are_weighed_by_their_profiles() -> None:
    s = load_scenario("models-heavy-light")
    prep = prepare(s)
    sim = Simulation(setup_for(prep, workload_for(prep)), "qos")
    heavy = sim.sched.pricing.weights.of("heavy")
    assert (heavy.prompt, heavy.output, heavy.source) == (pytest.approx(10.0),
                                                          pytest.approx(10.0), "profile")
    unweighted = override(s, config={**s.config, "models": []})
    prep = prepare(unweighted)
    sim = Simulation(setup_for(prep, workload_for(prep)), "qos")
    assert sim.sched.pricing.weights.of("heavy").source == "reference"


def test_the_report_has_each_tenant_s_engine_time_and_jain_over_it() -> None:
    s = override(load_scenario("models-heavy-light"), duration_s=5.0, warmup_s=1.0)
    res = run_scenario(prepare(s))
    (run,) = res.runs
    api = run.metrics["engine_time"]["api"]
    assert set(api["tenants"]) == {"t-heavy", "t-light"}
    assert 0.5 <= api["jain"] <= 1.0
    shares = [t["share"] for t in api["tenants"].values()]
    assert math.fsum(shares) == pytest.approx(1.0)
    doc: dict[str, Any] = document(res)
    assert doc["runs"][0]["engine_time"]["api"]["jain"] == pytest.approx(api["jain"], rel=1e-3)
    assert doc["scenario"]["models"]["served"] == {"r0": ["heavy", "light"],
                                                   "r1": ["heavy", "light"]}


def _raw(**changes: Any) -> dict[str, Any]:
    raw = load_scenario("models-heavy-light").model_dump(by_alias=True)
    raw.update(changes)
    return raw


def test_scenario_errors_for_models() -> None:
    with pytest.raises(ScenarioError, match="served by no replica group"):
        scenario_from_mapping(_raw(replicas=[{"count": 1, "models": ["light"]}]))
    with pytest.raises(ScenarioError, match=r"arrivals\.rate"):
        scenario_from_mapping(_raw(arrivals={"process": "poisson", "load": 1.0}))
    bad = _raw(model_profiles={"heavy": {"profile": "no-such-profile"}})
    with pytest.raises(ScenarioError, match="no-such-profile"):
        prepare(scenario_from_mapping(bad))
