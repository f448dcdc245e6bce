"""The driver's log of replica health: every change told, one line per replica per 30 s at most
(the changes in between counted), and a replica that stays down reminded every 300 s. The
driver probes a stub engine on an injected clock."""

from __future__ import annotations

import asyncio
import logging

import pytest

from qosgate.config import default_config
from qosgate.core import ReplicaSpec, Scheduler
from qosgate.runtime.driver import Driver
from qosgate.runtime.ports import Health


class Stub:
    """An engine whose probe answers ``up`` as the test sets it."""

    name = "a"
    max_window = 1
    pausable = False
    resumes = False
    ordered = False
    remote = False

    def __init__(self) -> None:
        self.up = True

    @property
    def ready(self) -> bool:
        return self.up

    def models(self) -> list[str]:
        return ["m"]

    async def probe(self) -> Health:
        return Health(up=self.up, models=("m",))


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "qosgate.runtime"]


def probes(eng: Stub, states: list[tuple[float, bool]]) -> None:
    """Probe the stub once at each (time, up)."""
    now = [0.0]
    sched = Scheduler(default_config(), None, [ReplicaSpec("a", 1, False, models=("m",))])
    drv = Driver(sched, {"a": eng}, clock=lambda: now[0])  # type: ignore[dict-item]

    async def run() -> None:
        for t, up in states:
            now[0], eng.up = t, up
            await drv.probe_all()

    asyncio.run(run())


def test_a_flapping_replica_is_told_once_per_interval_with_its_changes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "qosgate.runtime")
    states = [(0.0, True), (1.0, False)]  # up, then down: told at once
    states += [(2.0, True), (3.0, False), (4.0, True), (5.0, False)]  # flaps: held
    states += [(20.0, False), (31.0, False)]  # the interval since the last line is over
    probes(Stub(), states)
    assert lines(caplog) == [
        "replica a is down",
        "replica a is down (it changed 4 times in the last 30 s; one line per 30 s is logged)",
    ]


def test_a_dead_replica_is_reminded_and_its_return_told(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "qosgate.runtime")
    eng = Stub()
    states = [(0.0, True), (10.0, False)]
    states += [(t, False) for t in range(11, 700, 50)]  # down for long
    states += [(700.0, True), (701.0, False), (760.0, False)]
    probes(eng, states)
    assert lines(caplog) == [
        "replica a is down",
        "replica a is still down (for 301 s)",  # at 311 s
        "replica a is still down (for 601 s)",  # at 611 s
        "replica a is up",  # at 700 s: 89 s after the last line
        "replica a is down",  # changed at 701 s, told at 760 s (30 s after the line before)
    ]
