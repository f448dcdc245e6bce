"""The TTFT forecast's learners: the first token's service time, and the calibration factor."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.core.forecast import Calibration, FirstTokenTime


def test_first_token_time_knows_nothing_before_a_sample() -> None:
    assert FirstTokenTime().line() == (0.0, 0.0)
    assert FirstTokenTime().seconds(10_000) == 0.0


def test_first_token_time_fits_prefill_speed_and_one_step() -> None:
    rng = random.Random(7)
    ft = FirstTokenTime()
    for _ in range(400):  # a 40 ms step, 5,000 prompt tokens a second, with noise
        n = rng.randrange(10, 8_000)
        ft.add(n, 0.04 + n / 5_000 + rng.uniform(-0.005, 0.005))
    base, slope = ft.line()
    assert base == pytest.approx(0.04, abs=0.005)
    assert slope == pytest.approx(1 / 5_000, rel=0.02)
    assert ft.seconds(20_000) == pytest.approx(4.04, rel=0.03)


def test_first_token_time_follows_a_slower_engine() -> None:
    ft = FirstTokenTime()
    for i in range(300):
        ft.add(100 + i % 50, 0.1)
    for i in range(300):  # the engine got busy: its queue adds a second
        ft.add(100 + i % 50, 1.1)
    assert ft.seconds(125) == pytest.approx(1.1, abs=0.05)


def test_one_prompt_length_gives_the_mean_and_no_slope() -> None:
    ft = FirstTokenTime()
    for d in (0.2, 0.4, 0.3):
        ft.add(512, d)
    base, slope = ft.line()
    assert slope == 0.0 and base == pytest.approx(0.3, abs=0.01)


@settings(derandomize=True, max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 100_000), st.floats(0.0, 100.0)), min_size=1,
                max_size=60))
def test_a_forecast_is_never_negative_nor_falls_with_a_longer_prompt(
        samples: list[tuple[int, float]]) -> None:
    """The promise: a longer prompt never starts sooner, and no prompt before dispatch."""
    ft = FirstTokenTime()
    for n, d in samples:
        ft.add(n, d)
    base, slope = ft.line()
    assert base >= 0.0 and slope >= 0.0
    assert ft.seconds(0) <= ft.seconds(1_000) <= ft.seconds(100_000)


def test_calibration_is_one_until_enough_outcomes_near_the_edge() -> None:
    cal = Calibration(2, quantile=0.9, min_samples=10)
    for _ in range(9):
        cal.add(0, actual=8.0, forecast=4.0, budget=5.0)
    assert cal.factor(0) == 1.0
    for _ in range(50):  # far below the budget: says nothing of the edge
        cal.add(0, actual=0.5, forecast=0.1, budget=5.0)
    assert cal.factor(0) == 1.0
    cal.add(0, actual=8.0, forecast=4.0, budget=5.0)
    assert cal.factor(0) == 2.0
    assert cal.factor(1) == 1.0  # each class its own
    assert (cal.seen[0], cal.met[0]) == (60, 50)


def test_calibration_takes_the_quantile_of_the_ratios() -> None:
    cal = Calibration(1, quantile=0.9, window=100)
    for i in range(100):  # ratios 1.00 .. 1.99
        cal.add(0, actual=3.0 * (1 + i / 100), forecast=3.0, budget=5.0)
    assert cal.factor(0) == pytest.approx(1.89)
    for _ in range(100):  # the window slides: only the last 100 count
        cal.add(0, actual=3.3, forecast=3.0, budget=5.0)
    assert cal.factor(0) == pytest.approx(1.1)


def test_calibration_never_trusts_a_forecast_to_be_pessimistic() -> None:
    cal = Calibration(1, quantile=0.95)
    for _ in range(50):
        cal.add(0, actual=1.0, forecast=4.0, budget=5.0)
    assert cal.factor(0) == 1.0


@settings(derandomize=True, max_examples=100)
@given(st.lists(st.floats(0.2, 3.0), min_size=200, max_size=400), st.floats(0.5, 0.99))
def test_admitting_by_the_factor_meets_the_quantile(errors: list[float], q: float) -> None:
    """The promise, on exchangeable errors: of the requests a calibrated factor admits (those
    whose forecast times the factor is within the budget), at least about ``q`` are on time."""
    half = len(errors) // 2
    cal = Calibration(1, quantile=q, window=half, min_samples=1, high=100.0)
    for e in errors[:half]:
        cal.add(0, actual=4.0 * e, forecast=4.0, budget=5.0)
    k = cal.factor(0)
    on_time = [(4.0 * e) / 4.0 <= k for e in errors[:half]]
    assert sum(on_time) >= q * half - 1e-9
