"""One loop timer that fires at the earliest deadline it was armed for: the scheduler's timers
(``driver.py``) and an embeddings linger (``batching.py``) both wake this way -- nothing sleeps in
a loop, and re-arming for a later deadline costs nothing."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

SLACK_S = 0.0005  # fire a little late rather than early: the deadline is then surely due


class DeadlineTimer:
    __slots__ = ("_at", "_handle", "callback", "clock", "loop")

    def __init__(self, clock: Callable[[], float],
                 loop: Callable[[], asyncio.AbstractEventLoop],
                 callback: Callable[[], None]) -> None:
        self.clock = clock
        self.loop = loop
        self.callback = callback
        self._handle: asyncio.TimerHandle | None = None
        self._at = math.inf

    def arm(self, at: float) -> None:
        """Make sure ``callback`` runs by ``at`` (+ slack): an earlier deadline re-arms."""
        if self._handle is not None:
            if at >= self._at:
                return
            self._handle.cancel()
        self._at = at
        delay = max(0.0, at - self.clock()) + SLACK_S
        self._handle = self.loop().call_later(delay, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self._at = math.inf

    def _fire(self) -> None:
        self._handle = None
        self._at = math.inf
        self.callback()
