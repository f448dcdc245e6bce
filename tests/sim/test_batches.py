"""Batch jobs in the simulator: fed into the one scheduler beside live traffic by the shared feed
policy (core/batches_feed.py), every line answered exactly once, live classes first, jobs in
deadline order, the same report for the same seed, and runs without jobs as they were."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from qosgate.cli import app
from qosgate.config import QosConfig, default_config
from qosgate.core import Dispatch, QosInputs
from qosgate.core.batches_feed import RetryRule
from qosgate.settings import BatchSettings
from qosgate.sim.batches import BatchPlan, parse_batch, parse_duration
from qosgate.sim.batches_feed import SimBatches
from qosgate.sim.batches_metrics import batches_ok, fluid_finish
from qosgate.sim.driver import Simulation
from qosgate.sim.report import document, dumps
from qosgate.sim.results import RunResult
from qosgate.sim.scenario_file import scenario_from_mapping
from qosgate.sim.scenarios import prepare, run_scenario
from qosgate.sim.setup import SimSetup
from tests.support.classes import admitted_on_queue_time
from tests.support.sim import FLEET, SCENARIO, TOY, workload

runner = CliRunner()


def job(name: str, lines: int, at: float, window: float, cls: str = "batch",
        length: tuple[int, int] = (40, 12)) -> BatchPlan:
    return BatchPlan(name, at, window, cls, None, QosInputs(qos_class=cls),
                   (length,) * lines, 64)


def live(n: int, every: float, cls: str = "realtime") -> list[tuple[float, str, int, int]]:
    return [(0.05 + k * every, cls, 30, 10) for k in range(n)]


def setup(reqs: list[tuple[float, str, int, int]], jobs: tuple[BatchPlan, ...],
          cfg: QosConfig | None = None, **batches: float) -> SimSetup:
    return SimSetup(
        cfg=cfg or default_config(), profile=TOY, replicas=1, window=TOY.max_num_seqs,
        workload=workload(reqs), sample_interval=0.05, jobs=jobs,
        batches=BatchSettings.model_validate(batches), seed=3,
    )


class Watched(Simulation):
    """Checks, at every first dispatch of a job line, that no realtime request waits in the
    scheduler's queue (the strict band goes first: the scheduler's own invariant)."""

    violations: list[float]

    def _dispatch(self, d: Dispatch, now: float):  # type: ignore[no-untyped-def]
        if not d.resume and self.jobs is not None and d.req.id in self.jobs.owner:
            self.job_dispatches = getattr(self, "job_dispatches", 0) + 1
            queued = self._holder(d.req.id).snapshot(now).classes[0].queued
            if queued:
                self.violations = [*getattr(self, "violations", []), now]
        return super()._dispatch(d, now)


def test_a_job_beside_live_traffic_answers_every_line_exactly_once() -> None:
    res = Simulation(setup(live(60, 0.1, "api"), (job("j", 200, 0.0, 600.0),)), "qos").run()
    (rec,) = res.jobs
    assert (rec.done, rec.failed, rec.expired, rec.answered_twice) == (200, 0, 0, 0)
    assert rec.status == "completed" and rec.finished_at is not None
    assert res.job_outcomes == {"completed": 200} and res.job_attempts == 200
    assert batches_ok(res.jobs, res.job_outcomes, res.job_attempts)
    # the live requests keep their own ledger: job lines are neither records nor outcomes
    assert len(res.records) == res.arrivals == 60
    assert sum(res.outcomes.values()) == 60
    assert res.unfinished == 0


def test_the_feed_keeps_a_job_bounded_yet_fills_an_idle_fleet() -> None:
    # live traffic watched over 0.5 s: the spare slots reach the whole window 0.5 s in
    sim = Simulation(setup([], (job("j", 100, 0.0, 600.0),), queued_per_job=2,
                           live_span_s=0.5), "qos")
    seen: list[int] = []
    take = sim.jobs.take  # type: ignore[union-attr]

    def spy(capacity: int, in_scheduler: int, now: float) -> list[tuple[int, int, str]]:
        out = take(capacity, in_scheduler, now)
        seen.append(len(sim.jobs.jobs[0].in_flight))  # type: ignore[union-attr]
        return out

    sim.jobs.take = spy  # type: ignore[union-attr,method-assign]
    res = sim.run()
    assert res.jobs[0].done == 100
    assert max(seen) == TOY.max_num_seqs + 2  # the window full, two queued: never the file


def test_realtime_never_waits_while_a_job_line_is_dispatched() -> None:
    reqs = live(60, 0.1) + live(40, 0.15, "api")
    # api's own load is past its TTFT budget on this engine (deadline admission refuses some,
    # job or no job): admitted on queue time, every live request is queued and served
    cfg = default_config(classes=admitted_on_queue_time())
    sim = Watched(setup(reqs, (job("j", 300, 0.0, 600.0, "batch", (60, 30)),), cfg), "qos")
    res = sim.run()
    assert res.jobs[0].done == 300
    assert getattr(sim, "job_dispatches", 0) >= 300
    assert getattr(sim, "violations", []) == []
    assert all(r.state == "completed" for r in res.records)  # every live request served


def test_the_earlier_deadline_goes_first_across_two_jobs() -> None:
    late = job("late", 60, 0.0, 900.0)
    early = job("early", 60, 0.1, 300.0)  # submitted after, due before
    res = Simulation(setup([], (late, early), queued_per_job=1), "qos").run()
    by = {j.name: j for j in res.jobs}
    assert by["early"].done == by["late"].done == 60
    assert by["early"].finished_at is not None and by["late"].finished_at is not None
    assert by["early"].finished_at < by["late"].finished_at


def test_a_window_too_short_expires_the_rest_and_keeps_what_finished() -> None:
    res = Simulation(setup([], (job("j", 400, 0.0, 2.0, length=(40, 40)),), live_span_s=0.1),
                     "qos").run()
    (rec,) = res.jobs
    assert rec.status == "expired" and rec.finished_at == 2.0
    assert 0 < rec.done < 400 and rec.failed == 0
    assert rec.done + rec.expired == 400
    # the lines in flight at the window's end were cancelled: one outcome per attempt
    assert res.job_outcomes["cancelled"] > 0
    assert sum(res.job_outcomes.values()) == res.job_attempts
    assert batches_ok(res.jobs, res.job_outcomes, res.job_attempts)


def _engine_failure(sim: SimBatches, rid: str, now: float) -> float | None:
    return sim.ended(rid, "failed", "batch", None, 0, now)


def test_engine_failures_back_off_then_go_to_the_error_count() -> None:
    rule = RetryRule(retries=2, backoff_s=1.0, backoff_max_s=60.0)
    jobs = SimBatches((job("j", 1, 0.0, 100.0),), BatchSettings(queued_per_job=4), rule, 1)
    jobs.open(0, 0.0)
    now = 0.0
    for attempt in range(3):
        ((_, line, rid),) = jobs.take(4, 0, now)
        again = _engine_failure(jobs, rid, now)
        if attempt < 2:
            assert again is not None and now + 0.5 * 2**attempt <= again <= now + 2**attempt
            jobs.due(0, line)
            now = again
        else:
            assert again is None
    (rec,) = jobs.records()
    assert (rec.done, rec.failed, rec.retried, rec.status) == (0, 1, 2, "completed")


def test_a_refusal_that_asks_to_wait_spends_no_attempt() -> None:
    rule = RetryRule(retries=0, backoff_s=1.0, backoff_max_s=60.0)
    jobs = SimBatches((job("j", 1, 0.0, 100.0),), BatchSettings(queued_per_job=4), rule, 1)
    jobs.open(0, 0.0)
    ((_, line, rid),) = jobs.take(4, 0, 0.0)
    assert jobs.ended(rid, "rejected", "batch", 7.0, 0, 0.0) == 7.0
    jobs.due(0, line)
    ((_, _, rid),) = jobs.take(4, 0, 7.0)
    assert jobs.ended(rid, "completed", "batch", None, 12, 7.5) is None
    (rec,) = jobs.records()
    assert (rec.done, rec.failed, rec.waited, rec.retried) == (1, 0, 1, 0)


def test_fluid_estimate_walks_the_live_load() -> None:
    # no live traffic: the idle rate; the first minute fully busy: one minute later
    assert fluid_finish(600, 10.0, 0.0, [], 5.0) == 60.0
    busy = [k / 5.0 for k in range(300)]  # 5 req/s for 60 s = the live capacity
    assert fluid_finish(600, 10.0, 0.0, busy, 5.0) == pytest.approx(120.0)
    assert fluid_finish(600, 10.0, 0.0, busy, None) is None


def test_parse_job_and_durations() -> None:
    j = parse_batch("20000@5m/1h,class=offline,tenant=acme,prompt=300,output=50")
    assert (j.lines, j.at_s, j.window_s, j.qos_class, j.tenant) == (
        20000, 300.0, 3600.0, "offline", "acme")
    assert j.prompt is not None and j.output is not None
    d = parse_batch("5")
    assert (d.at_s, d.window_s, d.qos_class) == (0.0, 86400.0, None)
    assert parse_duration("1.5d") == 129600.0 and parse_duration("90") == 90.0
    assert parse_duration("0s") == 0.0 == parse_duration("0") == parse_batch("7@0s/1h").at_s
    with pytest.raises(ValueError):
        parse_batch("7@0s/0s")  # a window is never 0
    for bad in ("x@1h", "10/1y", "10,colour=red", "10,prompt=-3"):
        with pytest.raises(ValueError):
            parse_batch(bad)


JOB_SCENARIO = SCENARIO.replace("policies: [fifo, qos, engine-priority]", "policies: [qos]") + """
jobs:
  - {lines: 300, at_s: 2, window_s: 600, class: offline}
  - {lines: 100, at_s: 0, window_s: 300, prompt: {dist: constant, value: 200},
     output: {dist: constant, value: 40}}
batches: {queued_per_job: 8}
"""


def _doc(text: str) -> str:
    sc = scenario_from_mapping(yaml.safe_load(text))
    return dumps(document(run_scenario(prepare(sc))))


def test_same_seed_same_report_with_jobs() -> None:
    first = _doc(JOB_SCENARIO)
    assert first == _doc(JOB_SCENARIO)
    doc = json.loads(first)
    off, on = doc["runs"]
    assert (off["jobs_on"], on["jobs_on"]) == (False, True)
    assert "jobs" not in off and set(on["jobs"]) == {"job1", "job2"}
    assert on["jobs"]["job1"]["class"] == "offline" and on["jobs"]["job2"]["class"] == "batch"
    for j in on["jobs"].values():
        assert j["done"] == j["lines"] and j["within_window"] and j["answered_twice"] == 0
        assert j["idle_fleet_s"] <= j["completion_s"]
    # the live requests are the same ones in both runs
    assert off["arrivals"] == on["arrivals"] and on["one_outcome_each"]
    assert [j["name"] for j in doc["scenario"]["jobs"]] == ["job1", "job2"]
    assert doc["scenario"]["batches"]["queued_per_job"] == 8


# sha-256 of the det scenarios' JSON documents, taken on main before batch jobs were added, and
# taken again where the core changed under them (a positive reserve keeps a slot; streams evicted,
# or on a replica that died, continue elsewhere; every class admitted against its TTFT budget,
# and the share of admitted requests within it reported)
NO_JOB_DIGESTS = {
    "det": "69c755ade703c0521658e1946a48e699c3167a246d391bb46956f878e0dd5f9c",
    "det-fleet": "e77d788473ad4e84d5ab6f4e14d6159141ff315052c1579e34af00318c48e055",
}


@pytest.mark.slow
@pytest.mark.parametrize("text", [SCENARIO, FLEET], ids=["det", "det-fleet"])
def test_without_jobs_the_report_is_byte_identical_to_before(text: str) -> None:
    name = yaml.safe_load(text)["name"]
    doc = _doc(text)
    assert hashlib.sha256(doc.encode()).hexdigest() == NO_JOB_DIGESTS[name]


def test_cli_job_option_prints_the_comparison_and_the_prediction(tmp_path: Path) -> None:
    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO)
    res = runner.invoke(app, ["simulate", "--scenario", str(p), "--policies", "qos",
                              "--job", "400@1s/10m,class=offline", "--job", "50/5m"])
    assert res.exit_code == 0, res.output
    out = res.output
    assert "qos +jobs" in out and "live classes without -> with the jobs" in out
    assert "prediction (qos +jobs): job1's 400 lines take" in out
    assert "prediction (qos +jobs): job2's 50 lines take" in out
    bad = runner.invoke(app, ["simulate", "--scenario", str(p), "--job", "many@1h"])
    assert bad.exit_code == 2 and "LINES@START/WINDOW" in bad.output


def test_a_job_for_an_unknown_tenant_is_refused_before_the_run(tmp_path: Path) -> None:
    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO)
    res = runner.invoke(app, ["simulate", "--scenario", str(p), "--job", "10,tenant=nobody"])
    assert res.exit_code == 2 and "nobody" in res.output


def test_run_result_defaults_carry_no_jobs() -> None:
    r = RunResult("qos", (), [], [], 1.0, 1.0, 0)
    assert (r.jobs, r.job_outcomes, r.job_attempts) == ([], {}, 0)
