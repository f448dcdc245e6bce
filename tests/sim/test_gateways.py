"""N gateway instances in front of one simulated fleet (``gateways:`` / ``--gateways``).

What must hold: one gateway is exactly the single-gateway simulator; gateways that receive
nothing change nothing; every request has one outcome, at the one gateway it reached; a
requests/min limit spread over N instances admits R + refill (+ the documented overshoot) with
the shared state and ~N x that without; tenants that reach different gateways are served fairly
only with the shared fair-share counters; and the shared state's own code runs in virtual time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from qosgate.cli import app
from qosgate.config import TenantLimits
from qosgate.core.ledger import LeasedLedger
from qosgate.core.peers import Load
from qosgate.core.shared import Bucket, Heartbeat, MemoryStore, SyncProtocol
from qosgate.sim.driver import Simulation, run_policy
from qosgate.sim.events import SyncDue
from qosgate.sim.report import csv_rows, document, dumps
from qosgate.sim.results import RunResult
from qosgate.sim.scenario_file import ScenarioError, load_scenario, override
from qosgate.sim.scenarios import Prepared, prepare, run_scenario, setup_for, workload_for
from qosgate.sim.setup import GatewayPlan
from tests.support.classes import admitted_on_queue_time

# four equal-weight api tenants and a realtime one on one replica, overloaded so that qosgate
# holds a queue; "rated" is limited to 20 requests/min and offers ~11 requests/s
SCENARIO = """
name: gw
description: a small synthetic scenario for the gateway tests
profile: qwen2.5-7b-instruct-h100
window: 48
policies: [qos]
seed: 5
duration_s: 30
warmup_s: 8
arrivals: {process: poisson, rate: 40}
lengths:
  prompt: {dist: lognormal, mean: 600, cv: 1.0, max: 6000}
  output: {dist: lognormal, mean: 200, cv: 1.0, max: 1500}
mix:
  - {share: 2, class: realtime, tenant: chat}
  - {share: 2, class: api, tenant: a}
  - {share: 2, class: api, tenant: b}
  - {share: 2, class: api, tenant: c}
  - {share: 2, class: api, tenant: d}
  - {share: 4, class: batch, tenant: rated}
config:
  tenants:
    - {name: chat, api_keys: [key-chat]}
    - {name: a, api_keys: [key-a]}
    - {name: b, api_keys: [key-b]}
    - {name: c, api_keys: [key-c]}
    - {name: d, api_keys: [key-d]}
    - {name: rated, api_keys: [key-rated], limits: {requests_per_minute: 20}}
tpot_slo_ms: {realtime: 200, api: 200, batch: 1000, offline: 1000}
"""
UNLIMITED = SCENARIO.replace(", limits: {requests_per_minute: 20}", "")


def _prep(tmp_path: Path, text: str = SCENARIO, **changes: Any) -> Prepared:
    p = tmp_path / "gw.yaml"
    p.write_text(text)
    s = load_scenario(p)
    if changes:
        s = override(s, **changes)
    return prepare(s)


def _on_queue_time(tmp_path: Path, **changes: Any) -> Prepared:
    """``UNLIMITED`` with its classes admitted on queue time (no deadline admission): for the
    fair-share counters' own test, whatever each gateway's admission refuses."""
    p = tmp_path / "gw.yaml"
    p.write_text(UNLIMITED)
    s = load_scenario(p)
    classes = [c.model_dump(mode="json") for c in admitted_on_queue_time()]
    return prepare(override(s, config={**dict(s.config), "classes": classes}, **changes))


def _run(prep: Prepared, plan: GatewayPlan, policy: str = "qos") -> RunResult:
    setup = setup_for(prep, workload_for(prep))
    return run_policy(replace(setup, gateways=plan), policy)


def _rows(r: RunResult, digits: int | None = None) -> list[tuple[Any, ...]]:
    """Each request's life, without the gateway it reached (times rounded to ``digits``)."""

    def t(x: float | None) -> float | None:
        return x if x is None or digits is None else round(x, digits)

    return [
        (x.rid, x.state, x.reason, t(x.first_token_at), t(x.finished_at), x.output_tokens,
         x.preemptions, x.replica)
        for x in r.records
    ]


@pytest.mark.slow
def test_one_gateway_is_the_single_gateway_simulator(tmp_path: Path) -> None:
    """Gateway options with one gateway change nothing: no shared state, same bytes."""
    prep = _prep(tmp_path)
    base = _run(prep, GatewayPlan())
    other = _run(prep, GatewayPlan(1, "skewed", (("a", (3,)),), True, 0.01, 0.2))
    assert _rows(base) == _rows(other)
    assert base.engine == other.engine and base.samples == other.samples
    assert base.shared == {} and other.shared == {}
    doc = json.loads(dumps(document(run_scenario(prep))))
    assert all("gateways" not in r for r in doc["runs"])  # a single gateway's document as before


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False])
def test_gateways_that_receive_nothing_change_nothing(tmp_path: Path, shared: bool) -> None:
    """Every tenant reaches gateway 0 only: the other instances (probing the same engines,
    syncing their empty counters) leave every request's life as with one gateway. (To 1e-9 s
    with the shared state: its sync instants cut the engines' closed-form decode stretches at
    other points, which moves a finish time in the last bits of a float.)"""
    prep = _prep(tmp_path, UNLIMITED)
    one = _run(prep, GatewayPlan())
    everyone = tuple((t, (0,)) for t in ("chat", "a", "b", "c", "d", "rated"))
    four = _run(prep, GatewayPlan(4, "skewed", everyone, shared))
    digits = 9 if shared else None
    assert _rows(one, digits) == _rows(four, digits)
    assert {x.gateway for x in four.records} == {0}
    if shared:
        syncs = four.shared["syncs"]
        assert isinstance(syncs, list) and min(syncs) >= 500  # 30 s / 50 ms each


@pytest.mark.slow
@pytest.mark.parametrize(
    "plan",
    [
        GatewayPlan(2, "round-robin"),
        GatewayPlan(3, "hash", shared=False),
        GatewayPlan(4, "skewed", (("a", (0,)), ("b", (0, 1))), True, 0.05, 0.01),
        GatewayPlan(4, "skewed", (("a", (2,)),), True, 0.2, 0.05),
    ],
    ids=["rr2", "hash3-own", "skew4-delay", "skew4-slow-sync"],
)
def test_one_outcome_per_request_across_gateways(tmp_path: Path, plan: GatewayPlan) -> None:
    prep = _prep(tmp_path)
    r = _run(prep, plan)
    n = len(workload_for(prep).arrivals)
    assert r.arrivals == n and len(r.records) == n
    assert len({x.rid for x in r.records}) == n
    assert r.unfinished == 0 and sum(r.outcomes.values()) == n
    per = [0] * plan.count
    for x in r.records:
        per[x.gateway] += 1
    assert sum(per) == n and all(per)  # every instance took some
    reach = dict(plan.reach)
    for x in r.records:  # a tenant only ever reached the gateways it may
        if x.tenant in reach:
            assert x.gateway in {i % plan.count for i in reach[x.tenant]}
    if plan.spread == "hash":  # a tenant sticks to one instance
        seen: dict[str, set[int]] = {}
        for x in r.records:
            seen.setdefault(x.tenant, set()).add(x.gateway)
        assert all(len(g) == 1 for g in seen.values())
    # the engines' evictions are split over the gateways whose requests they hit
    assert sum(r.gateway_evictions) == r.engine["kv_evictions"]
    # the same seed, the same run
    assert _rows(r) == _rows(_run(prep, plan))


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.0, 0.02])
def test_a_rate_limit_over_4_gateways_admits_r_not_4r(tmp_path: Path, delay: float) -> None:
    """docs/guides/several-instances.md: over a span T, admitted <= R + R T / 60 + the stock the
    instances hold (max(live, R/60) requests); without shared state each instance its own R."""
    prep = _prep(tmp_path)
    rpm = 20.0
    shared = _run(prep, GatewayPlan(4, "round-robin", shared=True, sync_delay=delay))
    own = _run(prep, GatewayPlan(4, "round-robin", shared=False))

    def admitted(r: RunResult) -> tuple[int, float, list[int]]:
        recs = [x for x in r.records if x.tenant == "rated"]
        span = max(x.arrival for x in recs) - min(x.arrival for x in recs)
        per = [0] * r.gateways
        for x in recs:
            if x.state != "rejected":
                per[x.gateway] += 1
        return sum(per), rpm + rpm * span / 60, per

    n, allowed, per = admitted(shared)
    held = max(4, rpm / 60)
    assert allowed - held <= n <= allowed + held, (n, allowed, per)
    m, allowed_own, per_own = admitted(own)
    assert m >= 4 * allowed_own - 4 * 2, (m, allowed_own, per_own)  # ~4R: each its own limit
    assert all(p >= allowed_own - 2 for p in per_own)


@pytest.mark.slow
def test_fair_share_across_gateways_needs_the_shared_counters(tmp_path: Path) -> None:
    """Tenant a reaches gateway 0 only, b gateways 0-1, c and d all four: with the shared
    fair-share counters the four equal-weight api tenants get close to even service; each
    instance on its own gives a and b less. (Jain 0.999; 0.939 while VTC's lifts were synced
    as service, docs/guides/several-instances.md.) Admitted on queue time: with deadline
    admission each gateway refuses on its own queue, and the busiest one, which a alone
    reaches, refuses a more (docs/experiments/goodput.md)."""
    prep = _on_queue_time(tmp_path, gateways={
        "counts": [4], "spread": "skewed", "reach": {"a": [0], "b": [0, 1]}})
    on = run_scenario(prep).runs[0]
    off = run_scenario(_on_queue_time(tmp_path, gateways={
        "counts": [4], "spread": "skewed", "reach": {"a": [0], "b": [0, 1]},
        "shared": False})).runs[0]
    j_on = on.metrics["fairness"]["api"]["jain"]
    j_off = off.metrics["fairness"]["api"]["jain"]
    assert j_on >= 0.95, on.metrics["fairness"]["api"]
    assert j_off < j_on - 0.05, (j_on, j_off)
    ratio = off.metrics["fairness"]["api"]["tenants"]
    assert ratio["a"]["ratio"] < ratio["d"]["ratio"]  # alone on one instance: less than d


def test_the_shared_state_runs_in_virtual_time() -> None:
    """The sync protocol is sans I/O: a sync yields one store call at a time and completes
    without asyncio, each call answered at the (virtual) time its driver chooses."""
    now = 0.0
    store = MemoryStore()
    ledger = LeasedLedger()
    ledger.limiter("t", TenantLimits(requests_per_minute=600), 0.0)
    sh = SyncProtocol(ledger, "gw0", None, 0.05)
    steps = sh.sync()
    calls = []
    with pytest.raises(StopIteration):
        call = next(steps)
        while True:
            calls.append(type(call))
            now += 0.5  # each answered half a second later
            call = steps.send(store.answer(call, now))
    assert calls == [Heartbeat, Bucket]  # the heartbeat, then the requests/min bucket
    assert sh.syncs == 1 and sh.live == 1
    assert ledger.limiters["t"].req_stock == 10  # a second of the limit


def test_each_gateway_hears_the_others_load_in_its_heartbeats(tmp_path: Path) -> None:
    """What one instance publishes (its queue per class, its completion rate) is what the other
    sums at its next heartbeat; admission reads it through ``admission.peers``."""
    prep = _prep(tmp_path, SCENARIO.replace("duration_s: 30", "duration_s: 10"))
    setup = replace(setup_for(prep, workload_for(prep)), gateways=GatewayPlan(count=2))
    sim = Simulation(setup, "qos")
    published: list[tuple[list[int], float] | None] = [None, None]
    heard: list[tuple[int, list[int], list[int], float, float]] = []
    for g, proto in enumerate(sim.gateways.shared):
        assert sim.gateways.schedulers[g].admission.peers is proto.peers
        load = proto.load
        assert load is not None

        def publish(g: int = g, load: Callable[[], Load] = load) -> Load:
            queued, rate = load()
            published[g] = (list(queued), rate)
            return queued, rate

        proto.load = publish
    sync_step = sim.gateways.sync_step

    def step(due: SyncDue, now: float) -> tuple[float, SyncDue]:
        out = sync_step(due, now)  # (no store delay: one call runs the whole sync)
        g = due.gateway
        peers = sim.gateways.shared[g].peers
        theirs = published[1 - g]
        if theirs is not None:
            levels = range(len(theirs[0]))
            heard.append((g, [peers.queued(lv) for lv in levels], theirs[0], peers.rate(),
                          theirs[1]))
        return out

    sim.gateways.sync_step = step  # type: ignore[method-assign]
    sim.run()
    assert {g for g, *_ in heard} == {0, 1}
    for _g, got, sent, got_rate, sent_rate in heard:
        assert got == sent and got_rate == sent_rate
    assert any(sum(got) > 0 for _, got, *_ in heard)  # a queue was held and heard
    assert any(rate > 0 for *_, rate, _ in heard)


@pytest.mark.slow
def test_cli_gateways(tmp_path: Path) -> None:
    p = tmp_path / "gw.yaml"
    p.write_text(SCENARIO.replace("duration_s: 30", "duration_s: 10"))
    out = CliRunner().invoke(app, ["simulate", "-s", str(p), "--gateways", "1,2",
                                   "--spread", "skewed", "--sync-delay-s", "0.01", "--no-plots"])
    assert out.exit_code == 0, out.output
    assert "gateways (tenant state: shared" in out.stdout
    assert "gw1" in out.stdout and "requests/min limits over the gateways" in out.stdout
    doc = CliRunner().invoke(app, ["simulate", "-s", str(p), "--gateways", "2",
                                   "--no-shared-state", "--json-only"])
    assert doc.exit_code == 0, doc.output
    parsed = json.loads(doc.stdout)
    assert parsed["scenario"]["gateways"]["counts"] == [2]
    run = parsed["runs"][0]
    assert run["gateways"]["count"] == 2 and run["gateways"]["shared"] == {}
    assert run["one_outcome_each"] is True
    for bad in (["--gateways", "x"], ["--gateways", ","], ["--gateways", "0"],
                ["--spread", "sticky"]):
        res = CliRunner().invoke(app, ["simulate", "-s", str(p), *bad])
        assert res.exit_code == 2, (bad, res.output)


def test_csv_says_which_gateway_count(tmp_path: Path) -> None:
    prep = _prep(tmp_path, SCENARIO.replace("duration_s: 30", "duration_s: 5"),
                 gateways={"counts": [1, 3]})
    rows = csv_rows(run_scenario(prep))
    assert {r["gateways"] for r in rows} == {1, 3}
    single = csv_rows(run_scenario(_prep(tmp_path, SCENARIO.replace("duration_s: 30",
                                                                    "duration_s: 5"))))
    assert all("gateways" not in r for r in single)  # one gateway: the CSV as before


def test_reach_names_known_tenants(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="unknown tenants"):
        _prep(tmp_path, gateways={"counts": [2], "spread": "skewed", "reach": {"zed": [0]}})


def _peak_concurrency(r: RunResult, tenant: str) -> int:
    """The most of ``tenant``'s admitted requests live at once (admitted at arrival, released at
    their end), across all gateways."""
    ev: list[tuple[float, int]] = []
    for x in r.records:
        if x.tenant == tenant and x.state != "rejected":
            ev += [(x.arrival, 1), (x.finished_at, -1)]
    peak = cur = 0
    for _, d in sorted(ev):  # a release before an admission at the same instant
        cur += d
        peak = max(peak, cur)
    return peak


@pytest.mark.slow
def test_a_concurrency_cap_holds_across_gateways(tmp_path: Path) -> None:
    """A tenant capped at 3 requests at once, sent round-robin to 4 gateways: the shared leases
    keep the fleet at 3; each instance on its own lets 3 through, 4 x 3 in all."""
    text = UNLIMITED.replace("- {name: rated, api_keys: [key-rated]}",
                             "- {name: rated, api_keys: [key-rated], limits: {max_concurrent: 3}}")
    prep = _prep(tmp_path, text)
    shared = _run(prep, GatewayPlan(4, "round-robin", shared=True, sync_delay=0.01))
    own = _run(prep, GatewayPlan(4, "round-robin", shared=False))
    assert _peak_concurrency(shared, "rated") <= 3
    assert _peak_concurrency(own, "rated") == 4 * 3
    assert sum(x.tenant == "rated" and x.state == "completed" for x in shared.records) > 10


@pytest.mark.slow
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(1, 10_000),
    count=st.integers(1, 4),
    spread=st.sampled_from(["round-robin", "hash", "skewed"]),
    shared=st.booleans(),
    delay=st.sampled_from([0.0, 0.003, 0.05]),
    interval=st.sampled_from([0.02, 0.05, 0.3]),
)
def test_property_one_outcome_each_wherever_it_arrived(
    tmp_path: Path, seed: int, count: int, spread: str, shared: bool, delay: float,
    interval: float,
) -> None:
    """Any seed, gateway count, spread and sync: every request has exactly one outcome, at the
    one gateway it reached (one the spread allows), and the rate limit holds within its bound
    with the shared state."""
    prep = _prep(tmp_path, SCENARIO.replace("duration_s: 30", "duration_s: 6"), seed=seed)
    reach = (("a", (0,)), ("b", (0, 1)))
    plan = GatewayPlan(count, spread, reach, shared, interval, delay)  # type: ignore[arg-type]
    r = _run(prep, plan)
    n = r.arrivals
    assert len(r.records) == n and len({x.rid for x in r.records}) == n
    assert r.unfinished == 0 and sum(r.outcomes.values()) == n
    assert all(0 <= x.gateway < count for x in r.records)
    if spread == "skewed":
        assert all(x.gateway == 0 for x in r.records if x.tenant == "a")
        assert all(x.gateway in (0, 1 % count) for x in r.records if x.tenant == "b")
    if shared or count == 1:
        recs = [x for x in r.records if x.tenant == "rated"]
        if recs:
            span = max(x.arrival for x in recs) - min(x.arrival for x in recs)
            admitted = sum(x.state != "rejected" for x in recs)
            assert admitted <= 20 + 20 * span / 60 + max(count, 20 / 60)
