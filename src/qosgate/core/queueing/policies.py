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
from qosgate.core.queueing.engine_order import order_value
from qosgate.core.queueing.nodes import FairSplit, KeyedQueue, Node, StrictBands, release
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
                 "root", "settle", "started", "tenant_fair", "tenant_weights")

    def __init__(self, name: str, root: Node, class_aware: bool, preemptive: bool,
                 order: Callable[[Request], int], tenant_fair: bool = False) -> None:
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
        # whether tenants share each class fairly (a light tenant waits behind its own share
        # of its class's queue, not all of it: what admission predicts a wait from)
        self.tenant_fair = tenant_fair
        # the engine-side order of a request just popped (see the module's docstring)
        self.order = order
        # a dispatched request started in its engine (or left it unstarted)
        self.started: Callable[[Request], None] = release
        # the tenants' weights its fair splits read (a reload changes them in place)
        self.tenant_weights: dict[str, float] = {}

    def __len__(self) -> int:
        return self.root.n


class _Shared:
    """What every policy's queue tree is built from: the config's class and tenant weights, and
    one arrival counter shared by all the tree's queues (ties go to the earlier push)."""

    __slots__ = ("cfg", "levels", "seq", "tenant_weights", "weights")

    def __init__(self, cfg: QosConfig) -> None:
        self.cfg = cfg
        self.seq = [0]
        self.levels = len(cfg.classes)
        self.weights = {c.level: c.weight for c in cfg.classes}
        self.tenant_weights = {t.name: t.weight for t in cfg.tenants}

    def class_weight(self, level: Hashable) -> float:
        assert isinstance(level, int)
        return self.weights[level]

    def tenant_weight(self, tenant: Hashable) -> float:
        assert isinstance(tenant, str)
        return self.tenant_weights.get(tenant, 1.0)

    def by_deadline(self) -> Node:
        return KeyedQueue(_deadline, self.seq)

    def by_tenant(self) -> Node:
        return FairSplit(_tenant, self.tenant_weight, self.by_deadline, tags=True)


def _class_rank(level: Hashable) -> int:
    assert isinstance(level, int)
    return level


def _fifo(sh: _Shared) -> Policy:
    return Policy("fifo", KeyedQueue(_arrival, sh.seq), class_aware=False, preemptive=False,
                  order=lambda req: order_value(0, req.arrival * _MS))


def _priority(sh: _Shared) -> Policy:
    bands: list[Node] = [KeyedQueue(_arrival, sh.seq) for _ in range(sh.levels)]
    return Policy("priority", StrictBands(bands, range(sh.levels)), class_aware=True,
                  preemptive=True, order=lambda req: order_value(req.level, req.arrival * _MS))


def _wfq(sh: _Shared) -> Policy:
    return Policy(
        "wfq",
        FairSplit(_class_level, sh.class_weight, sh.by_deadline, rank=_class_rank),
        class_aware=True,
        preemptive=False,
        order=lambda req: order_value(req.class_level, req.deadline * _MS),
    )


def _qos(sh: _Shared) -> Policy:
    strict = [c.level for c in sh.cfg.classes if c.strict]
    band_index = {lvl: i for i, lvl in enumerate(strict)}
    # a strict level waits in its own band, every other level in the shared one after them
    band_of_level = [band_index.get(lvl, len(strict)) for lvl in range(sh.levels)]

    strict_levels = frozenset(strict)

    def qos_order(req: Request) -> int:
        band = req.level if req.level in strict_levels else req.class_level
        return order_value(band, req.tag)

    qos_bands: list[Node] = [sh.by_tenant() for _ in strict]
    qos_bands.append(FairSplit(_class_level, sh.class_weight, sh.by_tenant, rank=_class_rank))
    return Policy("qos", StrictBands(qos_bands, band_of_level), class_aware=True, preemptive=True,
                  order=qos_order, tenant_fair=True)


# each policy by name, built from the config (one queue tree per scheduler)
POLICIES: dict[str, Callable[[_Shared], Policy]] = {
    "fifo": _fifo, "priority": _priority, "wfq": _wfq, "qos": _qos,
}

POLICY_NAMES = tuple(POLICIES)


def build_policy(cfg: QosConfig, name: str | None = None) -> Policy:
    """The policy called ``name`` (default: the config's)."""
    name = name or cfg.policy
    try:
        make = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}: choose fifo, priority, wfq or qos") from None
    shared = _Shared(cfg)
    policy = make(shared)
    policy.tenant_weights = shared.tenant_weights
    return policy
