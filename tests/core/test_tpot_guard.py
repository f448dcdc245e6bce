"""The TPOT guard's hold point: fixed, or learned from the strict streams' own TPOT."""

from __future__ import annotations

import pytest

from qosgate.core.tpot_guard import FixedGuard, LearnedGuard


def _batch(guard: LearnedGuard, ratio: float, n: int = 16) -> None:
    for _ in range(n):
        guard.on_stream_ended(ratio)


def test_a_fixed_guard_never_moves() -> None:
    g = FixedGuard(0.6)
    _batch(g, 3.0)  # type: ignore[arg-type]
    assert g.fraction == 0.6


def test_the_learned_guard_starts_loose_and_tightens_on_a_batch_that_misses() -> None:
    g = LearnedGuard()
    assert g.fraction == 1.5
    _batch(g, 1.2, n=15)
    assert g.fraction == 1.5  # judged only on a full batch
    g.on_stream_ended(1.2)
    assert g.fraction == pytest.approx(1.125)
    _batch(g, 1.2)
    assert g.fraction == pytest.approx(0.84375)
    for _ in range(10):
        _batch(g, 1.2)
    assert g.fraction == 0.5  # never below lowest


def test_the_learned_guard_stays_in_the_band_and_loosens_below_it() -> None:
    g = LearnedGuard()
    _batch(g, 1.2)
    _batch(g, 1.2)
    tight = g.fraction
    _batch(g, 0.85)  # between low (0.75) and high (0.95): stays
    assert g.fraction == tight
    _batch(g, 0.5)
    assert g.fraction == pytest.approx(tight + 0.05)
    for _ in range(40):
        _batch(g, 0.5)
    assert g.fraction == 1.5  # never above highest


def test_the_learned_guard_judges_a_quantile_not_the_mean() -> None:
    """Realtime's SLO is judged per request: one stream in sixteen far past the budget (the
    95th percentile of sixteen is the slowest) tightens the guard, although the batch's mean
    (0.41 of the budget) is well under ``low``; with it on the budget, the batch stays."""
    g = LearnedGuard()
    _batch(g, 0.3, n=15)
    g.on_stream_ended(2.0)
    assert g.fraction == pytest.approx(1.125)
    _batch(g, 0.8, n=15)
    g.on_stream_ended(0.9)  # the slowest inside the band
    assert g.fraction == pytest.approx(1.125)


@pytest.mark.parametrize("kwargs", [
    {"lowest": 0.0}, {"lowest": 2.0, "highest": 1.0}, {"low": 0.9, "high": 0.8},
    {"tighten": 1.0}, {"loosen": 0.0}, {"quantile": 0.0}, {"batch": 0},
])
def test_the_learned_guard_refuses_settings_that_cannot_work(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        LearnedGuard(**kwargs)  # type: ignore[arg-type]
