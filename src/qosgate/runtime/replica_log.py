"""The operator's log of replicas going down and coming back.

Every change of a replica's health is told, but at most one line per replica per ``every_s``:
a replica that flaps faster is told with its state now and how many changes the line sums up.
A replica that stays down is reminded every ``remind_s``, so that a dead upstream does not
vanish from the log after its first line. Pure bookkeeping on the clock it is given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass


@dataclass(slots=True)
class _Replica:
    up: bool
    since: float  # when it took its current state
    line_at: float  # when its last line was logged
    changes: int = 0  # changes not told yet


class ReplicaLog:
    def __init__(
        self, log: logging.Logger, every_s: float = 30.0, remind_s: float = 300.0
    ) -> None:
        self.log = log
        self.every_s = every_s
        self.remind_s = remind_s
        self._replicas: dict[str, _Replica] = {}

    def probed(self, name: str, up: bool, now: float) -> None:
        """What a probe of ``name`` found at ``now``. The first probe is not a change: the
        driver tells the replicas down at start-up itself."""
        r = self._replicas.get(name)
        if r is None:  # a replica down now was just told (start-up): a line, for the pace
            self._replicas[name] = _Replica(up, now, now if not up else -float("inf"))
            return
        if up != r.up:
            r.up, r.since = up, now
            r.changes += 1
        if now - r.line_at < self.every_s:
            return
        if r.changes == 1:
            self.log.log(logging.INFO if up else logging.WARNING, "replica %s is %s",
                         name, _state(up))
        elif r.changes > 1:
            self.log.warning(
                "replica %s is %s (it changed %d times in the last %.0f s; one line per "
                "%.0f s is logged)", name, _state(up), r.changes, now - r.line_at, self.every_s)
        elif not up and now - r.line_at >= self.remind_s:
            self.log.warning("replica %s is still down (for %.0f s)", name, now - r.since)
        else:
            return
        r.changes = 0
        r.line_at = now


def _state(up: bool) -> str:
    return "up" if up else "down"
