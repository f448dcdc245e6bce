"""The gateway instances in front of the one simulated fleet: one ``Scheduler`` each, which
instance an arrival reaches (``GatewayPlan.spread``), and, with several sharing tenant state,
their syncs with one in-memory store in virtual time (``core.shared``'s protocol, the gateway's
own, each store call answered ``sync_delay`` virtual seconds after it is made)."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from pathlib import Path

from qosgate.config import QosConfig
from qosgate.core import ReplicaSpec, Scheduler
from qosgate.core.ledger import LeasedLedger
from qosgate.core.peers import Load, load_of
from qosgate.core.shared import MemoryStore, StoreDown, SyncProtocol, prime, run_to_end
from qosgate.core.windows import FixedWindow
from qosgate.models.simmodel import EngineProfile, load_profile
from qosgate.models.token_times import apply_profiles
from qosgate.sim.events import SyncDue
from qosgate.sim.setup import PASSTHROUGH_WINDOW, GatewayPlan, PolicySetup, ReplicaPlan
from qosgate.sim.workload import Workload


class Gateways:
    """The instances (``schedulers``), where each request arrived (``of``), and the shared
    state's protocol per instance (``shared``: empty unless they share it)."""

    def __init__(self, cfg: QosConfig, ps: PolicySetup, plans: tuple[ReplicaPlan, ...],
                 plan: GatewayPlan, workload: Workload,
                 profiles: Mapping[str, EngineProfile] | None = None) -> None:
        self.plan = plan
        self.workload = workload
        self.schedulers: list[Scheduler] = []
        self.shared: list[SyncProtocol] = []
        self.store = MemoryStore()
        self.now = 0.0  # the store's clock at the sync under way (what the heartbeats are timed by)
        for g in range(max(1, plan.count)):
            ledger = LeasedLedger() if plan.sharing else None
            sched = Scheduler(cfg, ps.core_policy, ledger=ledger)
            # the models' weights from their engine profiles, as the gateway sets them
            apply_profiles(sched.pricing.weights, cfg.models, cfg.fairness.reference_model,
                           _profile_loader(profiles or {}))
            for rp in plans:
                if ps.passthrough:  # a fixed window nothing fills: the engine holds the queue
                    spec = ReplicaSpec(rp.name, PASSTHROUGH_WINDOW, pausable=rp.pausable,
                                       models=rp.models)
                    sched.add_replica(spec, FixedWindow(PASSTHROUGH_WINDOW))
                else:  # the window the config asks for, as the gateway's
                    sched.add_replica(
                        ReplicaSpec(
                            rp.name, rp.window, pausable=rp.pausable, models=rp.models,
                            window_mode=rp.window_mode, ordered=ps.engine_queue == "priority",
                            # an upstream-like replica models vLLM: a stream continues from
                            # its token ids (evicted, or moved off a replica that died)
                            resumes=not rp.pausable,
                        )
                    )
            self.schedulers.append(sched)
            if ledger is not None:
                proto = SyncProtocol(ledger, f"gw{g}", sched.policy.root, plan.sync_interval,
                                     load=self._load(sched), clock=lambda: self.now)
                sched.admission.peers = proto.peers  # admission predicts from the fleet's load
                self.shared.append(proto)
        for proto in self.shared:
            # as the gateway's startup: limiters for the configured tenants, one sync before
            # serving (here: before t = 0, whatever the store's delay)
            prime(proto.ledger, [(t.name, t.limits) for t in cfg.tenants], 0.0)
            try:
                run_to_end(proto.sync(), self.store, 0.0)
            except StoreDown as exc:  # pragma: no cover - the simulated store never fails
                proto.sync_failed(0.0, str(exc))
        self.of: dict[str, int] = {}  # request -> the gateway it arrived at
        self._route_n = 0
        self._route_tenant: dict[str, int] = {}
        n = len(self.schedulers)
        self._reach = {t: tuple(sorted({i % n for i in idx})) for t, idx in plan.reach}
        self._tenant_of: dict[int, str] = {}

    def _load(self, sched: Scheduler) -> Callable[[], Load]:
        """What ``sched``'s instance publishes in its heartbeats, read when it sends one."""
        return lambda: load_of(sched, self.now)

    def of_request(self, rid: str) -> Scheduler:
        """The gateway instance that holds ``rid``."""
        return self.schedulers[self.of.get(rid, 0)]

    def route(self, stream: int) -> int:
        """The gateway the next arrival (of ``stream``) reaches (see ``GatewayPlan``)."""
        n = len(self.schedulers)
        if n == 1:
            return 0
        spread = self.plan.spread
        if spread == "round-robin":
            self._route_n += 1
            return (self._route_n - 1) % n
        tenant = self._tenant_of.get(stream)
        if tenant is None:
            inputs = self.workload.inputs[stream]
            tenant = self._tenant_of[stream] = (
                self.schedulers[0].classifier.classify(inputs).tenant)
        if spread == "hash":
            return zlib.crc32(tenant.encode()) % n
        reach = self._reach.get(tenant) or tuple(range(n))
        k = self._route_tenant.get(tenant, 0)
        self._route_tenant[tenant] = k + 1
        return reach[k % len(reach)]

    def sync_step(self, due: SyncDue, now: float) -> tuple[float, SyncDue]:
        """Start a gateway's sync or answer its store call: it runs until its next store call
        (answered ``sync_delay`` later; at once without a delay) or to its end (the next one
        starts ``sync_interval`` after). Returns when, and what, is due next for it."""
        g = due.gateway
        proto = self.shared[g]
        self.now = now
        delay = self.plan.sync_delay
        steps = due.steps
        try:
            if steps is None:
                steps = proto.sync()
                call = next(steps)
            else:
                assert due.call is not None
                call = steps.send(self.store.answer(due.call, now))
            while delay <= 0:
                call = steps.send(self.store.answer(call, now))
        except StopIteration:
            return now + self.plan.sync_interval, SyncDue(g)
        except StoreDown as exc:  # pragma: no cover - the simulated store never fails
            proto.sync_failed(now, str(exc))
            return now + self.plan.sync_interval, SyncDue(g)
        return now + delay, SyncDue(g, steps, call)


def _profile_loader(profiles: Mapping[str, EngineProfile]) -> Callable[[str | Path], EngineProfile]:
    """A ``profile`` of the config's models: one of the scenario's ``model_profiles`` by its
    model's name, else a built-in profile or a file."""

    def load(name: str | Path) -> EngineProfile:
        found = profiles.get(str(name))
        return found if found is not None else load_profile(name)

    return load
