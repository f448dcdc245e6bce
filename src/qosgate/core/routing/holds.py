"""Requests a router leaves queued by choice (``Router.holds``), each until a bound: the
cache-aware router holds a request for its warm replica and for KV room on one."""

from __future__ import annotations

import math


class Holds:
    """Requests a router leaves queued by choice, each until when at most. An entry goes when
    its request is placed; one whose request ended while queued (cancelled, timed out) is
    dropped once it has expired, when the table grows past ``trim_at``."""

    __slots__ = ("trim_at", "until")

    def __init__(self, trim_at: int = 4096) -> None:
        self.until: dict[str, float] = {}
        self.trim_at = trim_at

    def get(self, rid: str) -> float | None:
        return self.until.get(rid)

    def hold(self, rid: str, until: float, now: float) -> None:
        self.until[rid] = until
        if len(self.until) > self.trim_at:
            self.until = {k: t for k, t in self.until.items() if t > now}

    def release(self, rid: str) -> None:
        self.until.pop(rid, None)

    def holds(self, rid: str, now: float) -> bool:
        until = self.until.get(rid)
        return until is not None and now < until

    def next_after(self, now: float) -> float:
        """The first bound still ahead (inf: none)."""
        return min((t for t in self.until.values() if t > now), default=math.inf)
