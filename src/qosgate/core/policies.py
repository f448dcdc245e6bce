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

Each policy also says how a dispatched request is ordered inside an engine's own waiting queue
(``Policy.order``, an ``engine_order`` value: band, then rank): the order the policy itself would
pick it in among what waits there.

- ``fifo``: one band, by arrival (classes mean nothing to it, so the engine is not told them).
- ``priority``: the level it is served at, then arrival.
- ``wfq``: its class, then deadline.
- ``qos``: the strict band it is served from, else its class; then the tenant's fair-share
  counter it was picked at. Class first, as in the strict bands: the weighted shares between
  classes are kept by what qosgate releases, and inside an engine the few requests that wait go
  most urgent class first.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from operator import attrgetter

from qosgate.config import QosConfig
from qosgate.core.engine_order import order_value
from qosgate.core.queues import FairSplit, KeyedQueue, Node, StrictBands, release
from qosgate.core.request import Request

_MS = 1000.0  # time ranks in milliseconds: finer than any engine's step


# the keys a queue orders by and splits on: attribute getters run in C, a ``def`` is a Python
# call on every push, pop and settle
_arrival: Callable[[Request], float] = attrgetter("arrival")
_deadline: Callable[[Request], float] = attrgetter("deadline")
_class_level: Callable[[Request], int] = attrgetter("class_level")
_tenant: Callable[[Request], Hashable] = attrgetter("tenant")


class Policy:
    """The root of a queue tree plus what the scheduler needs to know about it.

    ``push``/``pop``/``remove``/``restore``/``settle`` are the root's own bound methods (no wrapper
    call on the hot path).
    """

    __slots__ = ("class_aware", "name", "order", "pop", "preemptive", "push", "remove", "restore",
                 "root", "settle", "started")

    def __init__(self, name: str, root: Node, class_aware: bool, preemptive: bool,
                 order: Callable[[Request], int]) -> None:
        self.name = name
        self.root = root
        self.push: Callable[[Request], None] = root.push
        self.pop: Callable[[], Request | None] = root.pop
        self.remove: Callable[[Request], None] = root.remove
        self.restore: Callable[[Request], None] = root.restore
        self.settle: Callable[[Request, float], None] = root.settle
        # whether levels mean anything (aging, displacement, deadline admission need it)
        self.class_aware = class_aware
        # whether a more urgent request is always served first, so pulling a less urgent one
        # back actually makes room for it (strict bands); under wfq it would not
        self.preemptive = preemptive
        # the engine-side order of a request just popped (see the module's docstring)
        self.order = order
        # a dispatched request started in its engine (or left it unstarted)
        self.started: Callable[[Request], None] = release

    def __len__(self) -> int:
        return self.root.n




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

    def by_tenant() -> Node:
        return FairSplit(_tenant, tenant_weight, lambda: KeyedQueue(_deadline, seq),
                         tags=True)

    if name == "fifo":
        return Policy(name, KeyedQueue(_arrival, seq), class_aware=False, preemptive=False,
                      order=lambda req: order_value(0, req.arrival * _MS))
    if name == "priority":
        bands: list[Node] = [KeyedQueue(_arrival, seq) for _ in range(levels)]
        return Policy(name, StrictBands(bands, range(levels)), class_aware=True, preemptive=True,
                      order=lambda req: order_value(req.level, req.arrival * _MS))
    if name == "wfq":
        return Policy(
            name,
            FairSplit(_class_level, class_weight, lambda: KeyedQueue(_deadline, seq),
                      rank=class_rank),
            class_aware=True,
            preemptive=False,
            order=lambda req: order_value(req.class_level, req.deadline * _MS),
        )
    if name == "qos":
        strict = [c.level for c in cfg.classes if c.strict]
        band_index = {lvl: i for i, lvl in enumerate(strict)}
        # a strict level waits in its own band, every other level in the shared one after them
        band_of_level = [band_index.get(lvl, len(strict)) for lvl in range(levels)]

        strict_levels = frozenset(strict)

        def qos_order(req: Request) -> int:
            band = req.level if req.level in strict_levels else req.class_level
            return order_value(band, req.tag)

        qos_bands: list[Node] = [by_tenant() for _ in strict]
        qos_bands.append(FairSplit(_class_level, class_weight, by_tenant, rank=class_rank))
        return Policy(name, StrictBands(qos_bands, band_of_level), class_aware=True,
                      preemptive=True, order=qos_order)
    raise ValueError(f"unknown policy {name!r}: choose fifo, priority, wfq or qos")


POLICY_NAMES = ("fifo", "priority", "wfq", "qos")
