"""A simulated replica's state in the driver (``driver.py``): its ``SimEngine`` and what the
driver must remember about it between steps."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from qosgate.models.simmodel import EngineProfile, SimEngine
from qosgate.models.step import FinishEvent, TokenEvent
from qosgate.sim.setup import scaled


class SimReplica:
    """One simulated replica as the driver sees it: its engine (replaced by a new, empty one
    when it dies), the engine's own clock, the events of its last step not yet delivered, and
    what the core paused or lost there."""

    __slots__ = (
        "alive",
        "base",
        "buf",
        "clock",
        "engine",
        "factor",
        "lost",
        "models",
        "name",
        "parked",
        "paused",
        "preempts",
        "queue",
        "retired",
        "seqs",
        "stuck",
        "timed",
        "told_up",
    )

    def __init__(
        self, name: str, profile: EngineProfile, queue: Literal["fcfs", "priority"],
        preempts: bool = True, models: Mapping[str, EngineProfile] | None = None,
        timed: bool = False,
    ) -> None:
        self.name = name
        self.base = profile
        self.models = dict(models or {})  # each model's profile where it serves several
        self.timed = timed  # its engines keep each seq's engine time
        self.queue: Literal["fcfs", "priority"] = queue
        self.preempts = preempts  # the engine's rule for a waiting seq (``SimEngine``)
        self.factor = 1.0
        self.engine = self.new_engine()
        self.clock = 0.0  # end of the engine's last step
        self.buf: list[TokenEvent | FinishEvent] | None = None  # events at ``clock``, undelivered
        self.stuck = False  # has work but cannot step until something changes
        # events of the step under way when qosgate paused the sequence: delivered on resume
        self.parked: dict[str, list[TokenEvent | FinishEvent]] = {}
        self.seqs: dict[str, None] = {}  # requests whose sequence is in this engine (in order)
        self.paused: set[str] = set()  # ... of which paused by qosgate
        # paused here when the engine died: rid -> (had streamed, tokens generated)
        self.lost: dict[str, tuple[bool, int]] = {}
        self.alive = True
        self.told_up = True  # what the core was last told (a probe, or a refused connect)
        self.retired: list[SimEngine] = []  # engines lost when it died (their counters count)

    def engines(self) -> list[SimEngine]:
        return [*self.retired, self.engine]

    def new_engine(self) -> SimEngine:
        """An empty engine of its profiles, at its speed now (``factor``)."""
        return SimEngine(scaled(self.base, self.factor), self.queue, self.preempts,
                         {m: scaled(p, self.factor) for m, p in self.models.items()},
                         self.timed)

    def slow(self, factor: float) -> None:
        """Every step from now on takes ``factor`` x as long as its profiles say."""
        self.factor = factor
        self.engine.profile = scaled(self.base, factor)
        self.engine.models = {m: scaled(p, factor) for m, p in self.models.items()}

    def drop(self, rid: str) -> None:
        if self.buf:
            self.buf = [e for e in self.buf if e.seq_id != rid] or None
        self.parked.pop(rid, None)

    def take(self, rid: str) -> list[TokenEvent | FinishEvent]:
        """Remove and return ``rid``'s undelivered events."""
        mine = [e for e in self.buf or () if e.seq_id == rid]
        if mine:
            self.drop(rid)
        return mine

    def finish_of(self, rid: str) -> FinishEvent | None:
        for e in [*(self.buf or ()), *self.parked.get(rid, ())]:
            if isinstance(e, FinishEvent) and e.seq_id == rid:
                return e
        return None

    def generated(self, rid: str) -> int:
        """Tokens the engine generated for ``rid`` so far (0 if it does not know it)."""
        try:
            return self.engine.generated(rid)
        except KeyError:
            fin = self.finish_of(rid)
            return fin.completion_tokens if fin is not None else 0

    def forget(self, rid: str) -> None:
        self.seqs.pop(rid, None)
        self.paused.discard(rid)
