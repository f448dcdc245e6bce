"""The queueing policies, chosen by name, each a small tree of queue nodes.

- ``fifo``: arrival order, classes ignored (the baseline every seed starts from).
- ``priority``: strict by level, arrival order inside a level (vLLM's ``--scheduling-policy
  priority``; note vLLM runs the *smaller* value first, as qosgate's levels do).
- ``wfq``: weighted shares between all classes (in tokens of service), arrival order inside.
- ``qos``: strict band(s) for the ``strict`` classes (realtime), weighted shares between the others
  (5:3:2 by default), per-tenant virtual-token-counter fairness inside every class, deadline order
  inside a tenant.

Aging is done by the scheduler for every class-aware policy: it moves a long waiter up a level.
Under ``priority`` (and into a strict band of ``qos``, if the ceiling allows) that lifts it over the
less urgent bands. Between weighted classes it stays in its own class's node, where its earlier
deadline puts it first: the shares (5:3:2) already keep every class moving, and a promoted request
served in the node of the class above took that class's turn while its own class paid, so under
sustained overload the class below took the turns of the class above (batch served more than api).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

from qosgate.config import QosConfig
from qosgate.core.queues import FairSplit, KeyedQueue, Node, StrictBands
from qosgate.core.request import Request


def _arrival(req: Request) -> float:
    return req.arrival


def _deadline(req: Request) -> float:
    return req.deadline


def _level(req: Request) -> int:
    return req.level


def _class_level(req: Request) -> int:
    return req.class_level


class Policy:
    """The root of a queue tree plus what the scheduler needs to know about it.

    ``push``/``pop``/``remove`` are the root's own bound methods (no wrapper call on the hot path).
    """

    __slots__ = ("class_aware", "name", "pop", "preemptive", "push", "remove", "restore",
                 "root")

    def __init__(self, name: str, root: Node, class_aware: bool, preemptive: bool) -> None:
        self.name = name
        self.root = root
        self.push: Callable[[Request], None] = root.push
        self.pop: Callable[[], Request | None] = root.pop
        self.remove: Callable[[Request], None] = root.remove
        self.restore: Callable[[Request], None] = root.restore
        # whether levels mean anything (aging, displacement, deadline admission need it)
        self.class_aware = class_aware
        # whether a more urgent request is always served first, so pulling a less urgent one
        # back actually makes room for it (strict bands); under wfq it would not
        self.preemptive = preemptive

    def __len__(self) -> int:
        return self.root.n

    def settle(self, req: Request, delta_cost: float) -> None:
        if delta_cost:
            self.root.settle(req, delta_cost)


def build_policy(cfg: QosConfig, name: str | None = None) -> Policy:
    name = name or cfg.policy
    seq = [0]
    levels = len(cfg.classes)
    weights = {c.level: c.weight for c in cfg.classes}
    tenant_weights = {t.name: t.weight for t in cfg.tenants}

    def class_weight(level: Hashable) -> float:
        assert isinstance(level, int)
        return weights[level]

    def class_rank(level: Hashable) -> int:
        assert isinstance(level, int)
        return level

    def tenant_weight(tenant: Hashable) -> float:
        assert isinstance(tenant, str)
        return tenant_weights.get(tenant, 1.0)

    def tenant_key(req: Request) -> Hashable:
        return req.tenant

    def by_tenant() -> Node:
        return FairSplit(tenant_key, tenant_weight, lambda: KeyedQueue(_deadline, seq))

    if name == "fifo":
        return Policy(name, KeyedQueue(_arrival, seq), class_aware=False, preemptive=False)
    if name == "priority":
        bands: list[Node] = [KeyedQueue(_arrival, seq) for _ in range(levels)]
        return Policy(name, StrictBands(bands, _level), class_aware=True, preemptive=True)
    if name == "wfq":
        return Policy(
            name,
            FairSplit(_class_level, class_weight, lambda: KeyedQueue(_deadline, seq),
                      rank=class_rank),
            class_aware=True,
            preemptive=False,
        )
    if name == "qos":
        strict = [c.level for c in cfg.classes if c.strict]
        band_index = {lvl: i for i, lvl in enumerate(strict)}
        shared = len(strict)

        def band_of(req: Request) -> int:
            return band_index.get(req.level, shared)

        qos_bands: list[Node] = [by_tenant() for _ in strict]
        qos_bands.append(FairSplit(_class_level, class_weight, by_tenant, rank=class_rank))
        return Policy(name, StrictBands(qos_bands, band_of), class_aware=True, preemptive=True)
    raise ValueError(f"unknown policy {name!r}: choose fifo, priority, wfq or qos")


POLICY_NAMES = ("fifo", "priority", "wfq", "qos")
