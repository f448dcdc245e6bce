"""What admission learns to forecast a request's time to first token, and how wrong it was.

A forecast is the wait in qosgate's queue (``Admission``) plus the first token's own service
time after dispatch: the wait in the engine's queue, the prefill of the prompt it does not hold
cached, and one step. Two learners, both fed facts the scheduler already has and both with the
clock passed in:

- ``FirstTokenTime``: the service time, as a line in the uncached prompt length, fitted to the
  dispatch-to-first-token times the fleet showed (decayed least squares: the engines' speed
  and load move, and a long prompt's prefill is what makes a short budget infeasible);
- ``Calibration``: per class, the ratio of admitted requests' actual TTFT to their forecast,
  taken at ``quantile``: admission multiplies a forecast by it, so that "admitted" means
  "meets its budget with probability ``quantile``" whatever the forecast's own bias: the seed
  articles' feedback loop.

Before it has seen anything, the service time is 0 and the factor 1: admission then errs
towards admitting, and the first late answers correct it. (The opposite
error, refusing what could have been served, leaves no sample to learn from.)
"""

from __future__ import annotations

import bisect
import math
from collections import deque


class FirstTokenTime:
    """Seconds from dispatch to first token, ``base + per_token * uncached prompt tokens``,
    fitted by least squares with each sample's weight decaying by ``keep`` per later sample."""

    __slots__ = ("_n", "_s", "_sd", "_sn", "_snd", "_snn", "keep", "samples")

    def __init__(self, keep: float = 0.98) -> None:
        self.keep = keep
        self._s = self._sn = self._snn = self._sd = self._snd = 0.0
        self._n = 0.0
        self.samples = 0

    def add(self, tokens: int, seconds: float) -> None:
        k = self.keep
        self._s = self._s * k + 1.0
        self._sn = self._sn * k + tokens
        self._snn = self._snn * k + tokens * tokens
        self._sd = self._sd * k + seconds
        self._snd = self._snd * k + tokens * seconds
        self.samples += 1

    def line(self) -> tuple[float, float]:
        """(base seconds, seconds per uncached prompt token): (0, 0) before any sample. The
        slope is never negative (a longer prompt never starts sooner), nor the base (a slope
        fitted to a few long prompts must not promise a short one less than nothing)."""
        s = self._s
        if s <= 0.0:
            return 0.0, 0.0
        mean_n, mean_d = self._sn / s, self._sd / s
        var = self._snn / s - mean_n * mean_n
        slope = (self._snd / s - mean_n * mean_d) / var if var > 1e-6 * (1.0 + mean_n) else 0.0
        if slope <= 0.0:
            return mean_d, 0.0
        base = mean_d - slope * mean_n
        if base < 0.0:
            # through the origin instead: the fit that keeps every forecast positive
            return 0.0, self._snd / self._snn
        return base, slope

    def seconds(self, tokens: int) -> float:
        base, slope = self.line()
        return base + slope * tokens


class Calibration:
    """Per class, the factor a forecast is multiplied by before it is compared with the budget:
    the ``quantile`` of the ratio of actual to forecast TTFT over the class's last ``window``
    admitted requests whose forecast took at least ``near`` of their budget (split conformal
    prediction: a request whose forecast times that factor is within its budget meets it with
    probability ``quantile``, whatever the forecast's bias; one forecast far below its budget
    meets it anyway, and its ratio, mostly noise of a short service time, says nothing of the
    edge). A request that timed out or was cancelled unanswered past its budget counts with
    the time it waited: late by at least that. Until a class has ``min_samples`` the factor is
    1, and it stays between ``low`` and ``high``: a forecast is never trusted to be pessimistic
    (ratios below 1 come from the same forecasts as the late ones, a TTFT earlier, and a factor
    below 1 admitted past the edge the burst that then missed)."""

    __slots__ = ("_ratios", "high", "low", "met", "min_samples", "near", "quantile", "seen")

    def __init__(self, classes: int, quantile: float, window: int = 100, min_samples: int = 10,
                 near: float = 0.25, low: float = 1.0, high: float = 4.0) -> None:
        self.quantile = quantile
        self.min_samples = min_samples
        self.near = near
        self.low = low
        self.high = high
        self._ratios = [_Ratios(window) for _ in range(classes)]
        self.seen = [0] * classes  # admitted requests whose outcome was seen
        self.met = [0] * classes  # ... of which on time

    def add(self, level: int, actual: float, forecast: float, budget: float) -> None:
        """An admitted request of class ``level`` had its first token ``actual`` seconds after
        arrival (or waited that long unanswered), against a forecast of ``forecast`` and a
        budget of ``budget`` seconds."""
        self.seen[level] += 1
        if actual <= budget:
            self.met[level] += 1
        if forecast >= self.near * budget:
            self._ratios[level].add(actual / forecast)

    def factor(self, level: int) -> float:
        ratios = self._ratios[level]
        if len(ratios.order) < self.min_samples:
            return 1.0
        return min(self.high, max(self.low, ratios.at(self.quantile)))


class _Ratios:
    """A sliding window of ratios, kept sorted as well, for its quantiles."""

    __slots__ = ("order", "sorted")

    def __init__(self, window: int) -> None:
        self.order: deque[float] = deque(maxlen=window)
        self.sorted: list[float] = []

    def add(self, ratio: float) -> None:
        order = self.order
        if len(order) == order.maxlen:
            del self.sorted[bisect.bisect_left(self.sorted, order[0])]
        order.append(ratio)
        bisect.insort(self.sorted, ratio)

    def at(self, quantile: float) -> float:
        """The ``quantile`` of the ratios (nearest rank, rounded up: never below it)."""
        s = self.sorted
        return s[min(len(s) - 1, max(0, math.ceil(quantile * len(s)) - 1))]
