"""The metrics arithmetic, checked against small cases computed by hand."""

from __future__ import annotations

import pytest

from qosgate.sim.metrics import (
    Slo,
    group_stats,
    jain,
    max_min_fair,
    meets_slo,
    percentile,
    tenant_fairness,
    tpot,
)
from qosgate.sim.results import RequestRecord


def rec(
    rid: str = "r",
    *,
    state: str = "completed",
    arrival: float = 0.0,
    first: float | None = 1.0,
    done: float = 2.0,
    out: int = 11,
    prompt: int = 100,
    cls: str = "api",
    tenant: str = "t",
    win_out: int | None = None,
    target: int | None = None,
) -> RequestRecord:
    return RequestRecord(
        rid=rid,
        stream=0,
        service_class=cls,
        tenant=tenant,
        state=state,
        reason=state,
        arrival=arrival,
        first_token_at=first,
        finished_at=done,
        prompt_tokens=prompt,
        output_tokens=out,
        target_output=out if target is None else target,
        preemptions=0,
        promotions=0,
        win_prefilled=first is not None,
        win_output=out if win_out is None else win_out,
    )


def test_percentile_linear_interpolation() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    # rank h = (n-1) p/100: p50 -> 1.5 -> 2.5; p90 -> 2.7 -> 3.7; p99 -> 2.97 -> 3.97
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 90) == pytest.approx(3.7)
    assert percentile(xs, 99) == pytest.approx(3.97)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(xs, 101)


def test_jain() -> None:
    assert jain([1, 1, 1]) == pytest.approx(1.0)
    assert jain([1, 0]) == pytest.approx(0.5)  # one gets all of two: 1/n
    assert jain([1, 2, 3]) == pytest.approx(36 / 42)  # (1+2+3)^2 / (3 * 14)
    assert jain([]) is None and jain([0, 0]) is None


def test_max_min_fair_water_filling() -> None:
    # capacity 5 for demands 1, 1, 5: the small ones get all, the flooder the rest
    assert max_min_fair([1, 1, 5], 5) == pytest.approx([1, 1, 3])
    # not enough for anyone's demand: equal split
    assert max_min_fair([4, 4, 4], 6) == pytest.approx([2, 2, 2])
    # more than asked: everyone gets its demand
    assert max_min_fair([1, 2], 10) == pytest.approx([1, 2])
    # weights 1:2 over capacity 6, both backlogged: 2 and 4
    assert max_min_fair([10, 10], 6, [1, 2]) == pytest.approx([2, 4])
    # weighted, one satisfied: demand 1 (w=1) < level; the other gets 5
    assert max_min_fair([1, 10], 6, [1, 1]) == pytest.approx([1, 5])


def test_tpot_and_slo() -> None:
    r = rec(arrival=0.0, first=0.5, done=2.5, out=11)  # 2.0 s over 10 gaps
    assert tpot(r) == pytest.approx(0.2)
    assert meets_slo(r, Slo(ttft_s=0.5, tpot_s=0.2))
    assert not meets_slo(r, Slo(ttft_s=0.49, tpot_s=0.2))
    assert not meets_slo(r, Slo(ttft_s=1.0, tpot_s=0.19))
    one = rec(first=0.5, done=0.5, out=1)  # one token: no TPOT, meets that half
    assert tpot(one) is None and meets_slo(one, Slo(1.0, 0.001))
    assert not meets_slo(rec(state="rejected", first=None, done=0.0, out=0), Slo(9, 9))


def test_group_stats_by_hand() -> None:
    recs = [
        rec("a", arrival=0.0, first=0.1, done=1.1, out=11),  # ttft .1 tpot .1 e2e 1.1: meets
        rec("b", arrival=1.0, first=1.3, done=3.3, out=11),  # ttft .3 tpot .2 e2e 2.3: misses
        rec("c", arrival=2.0, first=2.2, done=2.2, out=1),  # ttft .2, no tpot, e2e .2: meets
        rec("d", state="rejected", arrival=3.0, first=None, done=3.0, out=0),
        rec("e", state="timed_out", arrival=4.0, first=None, done=9.0, out=0),
    ]
    g = group_stats(recs, lambda r: Slo(ttft_s=0.25, tpot_s=0.15), arrival_span=10.0)
    assert (g["count"], g["completed"], g["rejected"], g["timed_out"]) == (5, 3, 1, 1)
    assert g["ttft_p50_ms"] == pytest.approx(200.0)
    assert g["ttft_mean_ms"] == pytest.approx(200.0)
    assert g["ttft_p99_ms"] == pytest.approx(298.0)  # .2 + .98 * (.3 - .2)
    assert g["tpot_p50_ms"] == pytest.approx(150.0)  # of [.1, .2]
    assert g["e2e_p50_ms"] == pytest.approx(1100.0)
    # 2 of 5 met (a, c): rejected and timed out count against attainment
    assert g["slo_met"] == 2
    assert g["slo_attainment"] == pytest.approx(0.4)
    assert g["goodput_rps"] == pytest.approx(0.2)
    assert g["completed_rps"] == pytest.approx(0.3)
    assert g["output_tok_s"] == pytest.approx(2.3)  # 23 tokens over 10 s


def test_goodput_counts_only_what_finishes_inside_the_arrival_span() -> None:
    # arrival span D = 10 s; the run ends at 40 s. Both requests meet the SLO, one finishes at 2 s,
    # the other while the backlog drains, at 30 s: goodput over the arrival span counts only the
    # first (1 / 10 s); the whole-run figure counts both over the whole run (2 / 40 s).
    slo = Slo(ttft_s=100.0, tpot_s=100.0)
    recs = [
        rec("in", arrival=0.0, first=1.0, done=2.0),
        rec("late", arrival=9.0, first=20.0, done=30.0),
    ]
    g = group_stats(recs, lambda r: slo, arrival_span=10.0, span=40.0)
    assert g["slo_met"] == 2 and g["completed"] == 2
    assert g["goodput_rps"] == pytest.approx(0.1)
    assert g["completed_rps"] == pytest.approx(0.1)
    assert g["goodput_rps_run"] == pytest.approx(2 / 40)
    assert g["completed_rps_run"] == pytest.approx(2 / 40)
    # without a span there is no whole-run figure
    assert group_stats(recs, lambda r: slo, arrival_span=10.0)["goodput_rps_run"] is None


def test_requests_hit_by_a_failed_attempt_are_counted() -> None:
    a = rec("a")
    a.failed_attempts = 1
    b = rec("b", state="failed", first=None, done=3.0, out=0)
    b.failed_attempts = 3
    g = group_stats([a, b, rec("c")], lambda r: Slo(9, 9), arrival_span=10.0)
    assert (g["failed_attempt"], g["failed_attempt_completed"], g["failed"]) == (2, 1, 1)


def test_empty_group() -> None:
    g = group_stats([], lambda r: Slo(1, 1), arrival_span=10.0)
    assert g["count"] == 0 and g["ttft_p99_ms"] is None and g["slo_attainment"] is None


def test_fairness_flooder_gets_the_rest_is_fair() -> None:
    # costs: prompt 100 + 2 * output 50 = 200 per request. a and b ask 2 requests (400) each,
    # the flooder f 10 (2000); 8 requests (1600) were granted: the max-min fair shares are
    # a 400, b 400, f 800. Giving exactly that is perfectly fair.
    recs = []
    for t, asked, got in (("a", 2, 2), ("b", 2, 2), ("f", 10, 4)):
        for i in range(asked):
            started = i < got
            recs.append(rec(f"{t}{i}", tenant=t, first=1.0 if started else None, out=50, done=5.0))
    f = tenant_fairness(recs, 10.0, 1.0, 2.0, lambda t: 1.0)
    assert f is not None
    assert f["tenants"]["f"]["fair_share"] == pytest.approx(800)
    assert f["jain"] == pytest.approx(1.0)
    assert f["service_gap"] == pytest.approx(0.0)
    assert f["jain_raw"] == pytest.approx(((400 + 400 + 800) ** 2) / (3 * (400**2 * 2 + 800**2)))


def test_fairness_proportional_service_is_unfair_to_the_small() -> None:
    # FIFO-like: everyone got half its demand (a 1 of 2, b 1 of 2, f 5 of 10): granted 1400.
    # Fair shares: a 400, b 400, f 600 -> ratios .5, .5, 1000/600.
    recs = []
    for t, asked, got in (("a", 2, 1), ("b", 2, 1), ("f", 10, 5)):
        for i in range(asked):
            recs.append(rec(f"{t}{i}", tenant=t, first=1.0 if i < got else None, out=50))
    f = tenant_fairness(recs, 10.0, 1.0, 2.0, lambda t: 1.0)
    assert f is not None
    r = [0.5, 0.5, 1000 / 600]
    assert f["jain"] == pytest.approx(sum(r) ** 2 / (3 * sum(x * x for x in r)))
    assert f["service_gap"] == pytest.approx(1000 / 600 - 0.5)


def test_fairness_arrival_span_and_warmup() -> None:
    recs = [
        rec("a0", tenant="a", arrival=0.0, first=0.5, out=50),  # granted before warmup
        rec("a1", tenant="a", arrival=2.0, first=3.0, out=50),  # in [1, 10]
        rec("b0", tenant="b", arrival=0.5, first=4.0, out=50),  # waiting at warmup, granted
        rec("b1", tenant="b", arrival=9.0, first=11.0, done=12.0, out=50),  # after the arrival span
    ]
    f = tenant_fairness(recs, 10.0, 1.0, 2.0, lambda t: 1.0, warmup=1.0)
    assert f is not None
    assert f["tenants"]["a"]["demand"] == pytest.approx(200)
    assert f["tenants"]["a"]["service"] == pytest.approx(200)
    assert f["tenants"]["b"]["demand"] == pytest.approx(400)
    assert f["tenants"]["b"]["service"] == pytest.approx(200)


def test_fairness_needs_two_tenants() -> None:
    assert tenant_fairness([rec()], 10.0, 1.0, 2.0, lambda t: 1.0) is None
