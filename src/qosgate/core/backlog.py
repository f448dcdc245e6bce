"""What waits in the queue, counted per class and per tenant: the books the scheduler keeps as
requests queue and leave, and that admission (the queue ahead of a newcomer) and the fleet (may a
reserve be lent, may anything queued go) read. Only the scheduler writes them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from qosgate.config import ServiceClass
from qosgate.core.replica import Replica
from qosgate.core.request import Request
from qosgate.core.snapshot import ClassView, TenantView


class Backlog:
    __slots__ = ("by_class", "by_tenant", "paused", "strict_levels", "total")

    def __init__(self, classes: Sequence[ServiceClass]) -> None:
        # queued requests per service class in queueing order (newest last: the displacement
        # victim)
        self.by_class: list[dict[str, Request]] = [{} for _ in classes]
        self.total = 0
        # queued requests per class and tenant: with fairness between tenants inside a class,
        # a light tenant's request waits behind its own share of the class's queue, not all of it
        self.by_tenant: list[dict[str, int]] = [{} for _ in classes]
        self.paused = 0  # queued requests paused on a replica (they resume only there)
        self.strict_levels = [c.level for c in classes if c.strict]

    def add(self, req: Request) -> None:
        self.by_class[req.class_level][req.id] = req
        self.total += 1
        tq = self.by_tenant[req.class_level]
        tq[req.tenant] = tq.get(req.tenant, 0) + 1

    def remove(self, req: Request) -> None:
        """``req`` leaves the queue (dispatched, or taken off it)."""
        del self.by_class[req.class_level][req.id]
        self.total -= 1
        tq = self.by_tenant[req.class_level]
        n = tq[req.tenant] - 1
        if n:
            tq[req.tenant] = n
        else:
            del tq[req.tenant]

    def strict_waits(self) -> bool:
        """A request of a strict class is queued."""
        by_class = self.by_class
        return any(by_class[lv] for lv in self.strict_levels)

    def newest_below(self, level: int) -> Request | None:
        """The newest queued request of the lowest class below ``level`` (the displacement
        victim), if any."""
        for lv in range(len(self.by_class) - 1, level, -1):
            bucket = self.by_class[lv]
            if bucket:
                return bucket[next(reversed(bucket))]
        return None

    def class_view(self, name: str, level: int, inflight: int, now: float) -> ClassView:
        bucket = self.by_class[level]
        oldest = 0.0
        if bucket:
            # insertion order is arrival order but for re-queued requests; a few suffice
            for i, r in enumerate(bucket.values()):
                oldest = max(oldest, now - r.arrival)
                if i >= 8:
                    break
        return ClassView(name, len(bucket), inflight, oldest)

    def tenant_rows(
        self, classes: Sequence[ServiceClass], replicas: Iterable[Replica], now: float,
        waits: bool,
    ) -> tuple[tuple[TenantView, ...], tuple[tuple[str, str, int], ...]]:
        """Per (tenant, class): queued, in flight and the oldest wait (walking the queue; with
        ``waits`` False, from the counts kept as requests queue, the wait read as 0); and per
        (replica, tenant): in flight."""
        acc: dict[tuple[str, str], list[float]] = {}
        if waits:
            for bucket in self.by_class:
                for r in bucket.values():
                    row = acc.setdefault((r.tenant, r.service_class), [0, 0, 0.0])
                    row[0] += 1
                    row[2] = max(row[2], now - r.arrival)
        else:
            for c, counts in zip(classes, self.by_tenant, strict=True):
                for tenant, n in counts.items():
                    acc[(tenant, c.name)] = [n, 0, 0.0]
        per_replica: Counter[tuple[str, str]] = Counter()
        for rep in replicas:
            for r in rep.inflight.values():
                acc.setdefault((r.tenant, r.service_class), [0, 0, 0.0])[1] += 1
                per_replica[(rep.name, r.tenant)] += 1
        rows = tuple(
            TenantView(t, c, int(v[0]), int(v[1]), v[2]) for (t, c), v in sorted(acc.items())
        )
        return rows, tuple((*k, v) for k, v in sorted(per_replica.items()))
