"""Whether a replica may take new work now: the ``Breaker`` seam and its algorithms.

``AlwaysClosed`` is the default; ``OutlierDetector`` ejects a replica after consecutive failures
before the first byte, for a time that grows with each ejection (Envoy's outlier detection, with
its defaults). ``build_breaker`` picks one from the config (``fleet.outlier``). The clock is passed
in, so the gateway and the simulator run the same ones.
"""

from __future__ import annotations

import random
from typing import Protocol

from qosgate.config import Outlier


class Breaker(Protocol):
    def allow(self, now: float) -> bool:
        """May the replica take new work at ``now``?"""
        ...

    def on_result(self, now: float, ok: bool) -> None:
        """An attempt ended: ``ok`` if it got its first byte, False if it failed before."""
        ...

    def next_change(self) -> float | None:
        """When ``allow`` may change by itself (an ejection ends), or None."""
        ...

    @property
    def ejections(self) -> int: ...

    @property
    def probation(self) -> bool:
        """Back from an ejection and not yet proven: the replica takes one request at a time."""
        ...

    def state(self, now: float) -> str:
        """``closed`` (serving) or ``open`` (ejected)."""
        ...


class AlwaysClosed:
    __slots__ = ()
    ejections = 0
    probation = False

    def allow(self, now: float) -> bool:
        return True

    def on_result(self, now: float, ok: bool) -> None:
        return None

    def next_change(self) -> float | None:
        return None

    def state(self, now: float) -> str:
        return "closed"


class OutlierDetector:
    """Eject after ``consecutive`` failures before the first byte, for ``base_s`` x the number of
    ejections so far, capped at ``max_s``, plus up to ``jitter`` of that at random (seeded), so
    that replicas ejected together do not all come back in the same instant. Envoy's defaults:
    5 consecutive 5xx / gateway failures, 30 s base, 300 s cap. Back from an ejection, a replica
    is on probation (half-open): one request at a time, and one failure ejects it again; its
    first success ends the probation."""

    __slots__ = ("_failures", "_rng", "base_s", "consecutive", "ejected_until", "ejections",
                 "jitter", "max_s", "probation")

    def __init__(
        self,
        consecutive: int = 5,
        base_s: float = 30.0,
        max_s: float = 300.0,
        jitter: float = 0.1,
        seed: int = 0,
    ) -> None:
        self.consecutive = consecutive
        self.base_s = base_s
        self.max_s = max_s
        self.jitter = jitter
        self._rng = random.Random(seed)
        self._failures = 0
        self.ejections = 0
        self.ejected_until = float("-inf")
        self.probation = False

    def allow(self, now: float) -> bool:
        return now >= self.ejected_until

    def on_result(self, now: float, ok: bool) -> None:
        if ok:
            self._failures = 0
            self.probation = False
            return
        if now < self.ejected_until:
            return  # failures of attempts sent before the ejection do not extend it
        self._failures += 1
        if self._failures >= self.consecutive or self.probation:
            self.probation = True
            self._failures = 0
            self.ejections += 1
            span = min(self.max_s, self.base_s * self.ejections)
            self.ejected_until = now + span * (1.0 + self.jitter * self._rng.random())

    def next_change(self) -> float | None:
        return self.ejected_until if self.ejected_until != float("-inf") else None

    def state(self, now: float) -> str:
        return "closed" if now >= self.ejected_until else "open"


def build_breaker(outlier: Outlier, seed: int) -> Breaker:
    """The breaker ``fleet.outlier`` asks for; ``seed`` makes each replica's jitter its own."""
    if not outlier.enabled:
        return AlwaysClosed()
    return OutlierDetector(outlier.consecutive_failures, outlier.base_ejection_s,
                           outlier.max_ejection_s, outlier.jitter, seed=seed)
