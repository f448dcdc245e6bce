"""Whether a refusal's Retry-After was honest: the retries sent and admitted, the waits the
refusals asked for, and how the retries spread over the seconds; and every attempt of one client
carries the first attempt's id as its retry key."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from qosgate.core import Decision, Request
from qosgate.sim.driver import Simulation, run_policy
from qosgate.sim.report import document
from qosgate.sim.results import RequestRecord, RunResult
from qosgate.sim.retry_after import RETRY_AFTER_DEFINITIONS, retried_waits, retry_after_stats
from qosgate.sim.scenario_file import load_scenario, override
from qosgate.sim.scenarios import prepare, run_scenario
from tests.support.sim import SCENARIO, crowded_api, workload


def _record(rid: str, cls: str, state: str, t: float, retry_of: str = "", attempt: int = 0,
            retry_after: float | None = None) -> RequestRecord:
    return RequestRecord(
        rid=rid, stream=0, service_class=cls, tenant="t", state=state, reason="", arrival=t,
        first_token_at=None, finished_at=t, prompt_tokens=1, output_tokens=0, target_output=1,
        preemptions=0, promotions=0, win_prefilled=False, win_output=0, retry_of=retry_of,
        attempt=attempt, retry_after=retry_after,
    )


def _result(records: list[RequestRecord]) -> RunResult:
    return RunResult(policy="qos", classes=("api", "batch"), records=records, samples=[],
                     arrivals_end=10.0, makespan=10.0, arrivals=len(records))


def test_figures_per_class_and_for_all() -> None:
    records = [
        # a: refused (wait 1), refused again (wait 3), then admitted
        _record("a", "api", "rejected", 0.0, retry_after=1.0),
        _record("a.retry1", "api", "rejected", 1.2, "a", 1, retry_after=3.0),
        _record("a.retry2", "api", "completed", 4.5, "a", 2),
        # b: refused (wait 1), retried once, refused for good: its last wait was not retried
        _record("b", "api", "rejected", 0.1, retry_after=1.0),
        _record("b.retry1", "api", "rejected", 1.4, "b", 1, retry_after=9.0),
        # c: refused (wait 2), admitted
        _record("c", "batch", "rejected", 0.0, retry_after=2.0),
        _record("c.retry1", "batch", "completed", 1.9, "c", 1),
        _record("d", "batch", "completed", 0.5),
    ]
    assert sorted(retried_waits(records)) == [("api", 1.0), ("api", 1.0), ("api", 3.0),
                                              ("batch", 2.0)]
    stats = retry_after_stats(_result(records))
    api = stats["classes"]["api"]
    assert api["retries_sent"] == 3 and api["retries_admitted"] == 1
    assert api["retry_success_rate"] == 1 / 3
    assert api["retry_after_p50_s"] == 1.0 and api["retry_after_max_s"] == 3.0
    assert api["retry_after_p90_s"] == 1.0 + 0.8 * 2.0  # type-7 between 1 and 3
    # seconds 1 (a.retry1, b.retry1) and 4 (a.retry2)
    assert api["retries_busiest_second"] == 2 and api["retries_per_second_mean"] == 1.5
    batch = stats["classes"]["batch"]
    assert batch["retries_sent"] == batch["retries_admitted"] == 1
    assert batch["retry_success_rate"] == 1.0
    total = stats["totals"]
    assert total["retries_sent"] == 4 and total["retries_admitted"] == 2
    assert total["retry_after_max_s"] == 3.0
    # seconds 1 (a.retry1, b.retry1, c.retry1) and 4
    assert total["retries_busiest_second"] == 3 and total["retries_per_second_mean"] == 2.0


def test_without_retries_nothing_is_sent() -> None:
    stats = retry_after_stats(_result([_record("a", "api", "rejected", 0.0, retry_after=1.0)]))
    api = stats["totals"]
    assert api["retries_sent"] == 0 and api["retries_busiest_second"] == 0
    assert api["retry_success_rate"] is None and api["retry_after_p50_s"] is None
    assert api["retries_per_second_mean"] is None


def test_four_refusals_retried_together_land_in_one_second() -> None:
    res = run_policy(crowded_api(2), "qos")
    refused = [r for r in res.records if r.attempt == 0 and r.state == "rejected"]
    assert len(refused) == 4 and all(r.retry_after is not None for r in refused)
    api = retry_after_stats(res)["classes"]["api"]
    assert api["retries_sent"] == api["retries_admitted"] == 4
    assert api["retry_success_rate"] == 1.0
    waits = sorted(r.retry_after for r in refused if r.retry_after is not None)
    assert api["retry_after_max_s"] == waits[-1] >= 1.0
    # refused together with the same wait, they come back in the same second: a storm of four
    assert api["retries_busiest_second"] == 4 and api["retries_per_second_mean"] == 4.0


def test_a_refused_retry_counts_as_sent_not_admitted() -> None:
    burst = [(t / 10, "api", 10, 400) for t in range(40)]
    res = run_policy(replace(crowded_api(1), workload=workload(burst)), "qos")
    api = retry_after_stats(res)["classes"]["api"]
    retries = [r for r in res.records if r.attempt > 0]
    refused_again = sum(1 for r in retries if r.state == "rejected")
    assert refused_again > 0
    assert api["retries_sent"] == len(retries)
    assert api["retries_admitted"] == len(retries) - refused_again
    assert api["retry_success_rate"] < 1.0


def test_every_attempt_carries_its_first_attempts_id_as_retry_key() -> None:
    sim = Simulation(crowded_api(2), "qos")
    sched = sim.gateways.schedulers[0]
    submit = sched.submit
    keys: dict[str, str | None] = {}

    def spy(req: Request, now: float) -> list[Decision]:
        keys[req.id] = req.retry_key
        return submit(req, now)

    sched.submit = spy  # type: ignore[method-assign]
    res = sim.run()
    assert len(keys) == res.arrivals == 14
    for r in res.records:
        assert keys[r.rid] == (r.retry_of or r.rid)
    assert all(k is not None and ".retry" not in k for k in keys.values())


def test_the_report_defines_the_figures_only_with_retries(tmp_path: Path) -> None:
    path = tmp_path / "det.yaml"
    path.write_text(SCENARIO.replace("rate: 14", "rate: 60")
                    .replace("policies: [fifo, qos, engine-priority]", "policies: [qos]"))
    plain = document(run_scenario(prepare(load_scenario(path))))
    assert not set(RETRY_AFTER_DEFINITIONS) & set(plain["definitions"])
    assert "retry_after" not in plain["runs"][0]
    retried = document(run_scenario(prepare(override(load_scenario(path), retries=3))))
    assert set(RETRY_AFTER_DEFINITIONS) <= set(retried["definitions"])
    figures = retried["runs"][0]["retry_after"]
    assert figures["totals"]["retries_sent"] > 0
    assert figures["totals"]["retries_sent"] == sum(
        c["retries_sent"] for c in figures["classes"].values())
