"""The other gateway instances' load, as their last heartbeats said: their queued requests per
class and their completions per second, summed (docs/guides/several-instances.md).

Why: admission predicts a request's wait from the queue ahead of it and the rate at which the
fleet completes requests. Several instances in front of one fleet each hold a part of the queue
and each see a part of the completions; one instance's own figures would make admission differ
with the instance a request happens to reach. So each instance publishes its load in its
heartbeat (``with_load``) and reads the others' from the heartbeat's answer (``PeerLoad.hear``);
its own figures plus these are the fleet's.

The store only answers instances whose heartbeat is live, so a stopped instance drops out with
the heartbeat's TTL. When this instance's own syncs fail, what it last heard ages: once older
than that TTL, it is forgotten (``expire``) rather than kept as if the others were still there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qosgate.core.scheduler import Scheduler

# this instance's load: its queued requests per class level, its completions per second
Load = tuple[Sequence[int], float]
QUEUED_KEY = "queued_by_class"
RATE_KEY = "completion_rate"


def load_of(scheduler: Scheduler, now: float) -> Load:
    """What an instance publishes: its scheduler's queue per class and completion rate (the
    one its own admission forecasts from: measured while saturated, so that the fleet's sum is
    the fleet's capacity, not what it happened to be sent)."""
    return ([len(bucket) for bucket in scheduler.backlog.by_class],
            scheduler.admission.local_rate(now))


def with_load(info: str, load: Load) -> str:
    """The heartbeat's info (a JSON object; what it carried is kept) with ``load`` merged in."""
    data = json.loads(info) if info else {}
    if not isinstance(data, dict):
        data = {}
    queued, rate = load
    data[QUEUED_KEY] = [int(n) for n in queued]
    data[RATE_KEY] = float(rate)
    return json.dumps(data, separators=(",", ":"))


def load_in(info: str) -> Load | None:
    """The load an instance's info carries (None: it published none, or not as JSON)."""
    try:
        data = json.loads(info)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    queued = data.get(QUEUED_KEY)
    rate = data.get(RATE_KEY)
    if not isinstance(queued, list) or not isinstance(rate, int | float):
        return None
    if not all(isinstance(n, int) for n in queued) or not math.isfinite(rate):
        return None
    return queued, float(rate)


class PeerLoad:
    """The other live instances' load, summed, as the last heartbeat answer said (``heard_at``,
    on this instance's clock); forgotten once that is ``ttl`` old."""

    __slots__ = ("_queued", "_rate", "heard_at", "instances", "ttl")

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self._queued: list[int] = []
        self._rate = 0.0
        self.instances = 0  # the other instances that published a load
        self.heard_at: float | None = None

    def hear(self, fleet: Mapping[str, str], me: str, now: float) -> None:
        """A heartbeat's answer (live instance -> info): every instance but ``me``."""
        queued: list[int] = []
        rate = 0.0
        instances = 0
        for instance, info in fleet.items():
            if instance == me:
                continue
            load = load_in(info)
            if load is None:  # an instance that publishes no load adds none
                continue
            theirs, their_rate = load
            if len(theirs) > len(queued):
                queued += [0] * (len(theirs) - len(queued))
            for level, n in enumerate(theirs):
                queued[level] += n
            rate += their_rate
            instances += 1
        self._queued = queued
        self._rate = rate
        self.instances = instances
        self.heard_at = now

    def queued(self, level: int) -> int:
        """The other instances' queued requests of the class at ``level``."""
        return self._queued[level] if 0 <= level < len(self._queued) else 0

    def rate(self) -> float:
        """The other instances' completions per second."""
        return self._rate

    def age(self, now: float) -> float:
        """Seconds since the last heartbeat answer (infinite before the first)."""
        return math.inf if self.heard_at is None else max(0.0, now - self.heard_at)

    def expire(self, now: float) -> None:
        """Forget the others' load once what was heard is ``ttl`` old (this instance's syncs
        have failed since: the others' heartbeats may have expired unseen)."""
        if self.heard_at is not None and self.age(now) >= self.ttl:
            self._queued = []
            self._rate = 0.0
            self.instances = 0
