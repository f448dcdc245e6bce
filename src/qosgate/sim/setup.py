"""What one simulated run is made of: the policy (the core's, the engine's own queue, the
qosgate window), the replicas, the gateway instances in front of them, the faults, the workload,
and the clients' retries. ``scenarios.py`` builds a ``SimSetup`` from a scenario file; the driver
(``driver.py``) runs one per policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from qosgate.config import QosConfig
from qosgate.core import POLICY_NAMES
from qosgate.models.simmodel import EngineProfile
from qosgate.settings import BatchSettings
from qosgate.sim.batches import BatchPlan
from qosgate.sim.workload import Workload

PASSTHROUGH_WINDOW = 1 << 30
SIM_POLICIES: tuple[str, ...] = (*POLICY_NAMES, "engine-priority", "engine-fcfs")
@dataclass(slots=True, frozen=True)
class PolicySetup:
    """A simulated policy: the core policy, the engine's own queue, and the qosgate window."""

    name: str
    core_policy: str
    engine_queue: Literal["fcfs", "priority"]
    passthrough: bool  # window = PASSTHROUGH_WINDOW: the engine holds the whole queue


EngineQueue = Literal["auto", "fcfs", "priority"]


def policy_setup(name: str, engine_queue: EngineQueue = "auto") -> PolicySetup:
    """``engine_queue="auto"``: the engine's own queue is FCFS under ``fifo`` (no priorities
    anywhere: the baseline) and vLLM-priority under the class-aware policies, which forward
    qosgate's order as the engine priority (as the gateway does, ``core.queueing.engine_order``);
    ``engine-priority`` always uses the engine's priority queue; ``engine-fcfs`` is a raw engine
    with no gateway in front (everything passed through to its FCFS queue)."""
    if name == "engine-priority":
        return PolicySetup(name, "fifo", "priority", True)
    if name == "engine-fcfs":
        return PolicySetup(name, "fifo", "fcfs", True)
    if name not in POLICY_NAMES:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(SIM_POLICIES)}")
    if engine_queue == "auto":
        return PolicySetup(name, name, "fcfs" if name == "fifo" else "priority", False)
    return PolicySetup(name, name, engine_queue, False)


@dataclass(slots=True, frozen=True)
class ReplicaPlan:
    """One simulated replica: its name, engine profile, qosgate window, and whether it pauses."""

    name: str
    profile: EngineProfile
    window: int
    pausable: bool = True
    # the core's window mode for it: "adaptive" (``window`` is then its ceiling) or "fixed";
    # None: the core's default (fixed for a pausable replica, ``fleet.window.mode`` otherwise)
    window_mode: Literal["fixed", "adaptive"] | None = None
    # the models it serves (empty: any) and the engine profile of each, where it has several
    # (``SimEngine``'s ``models``: each model's pass in turn in one step)
    models: tuple[str, ...] = ()
    model_profiles: tuple[tuple[str, EngineProfile], ...] = ()


Spread = Literal["round-robin", "hash", "skewed"]
SPREADS: tuple[str, ...] = ("round-robin", "hash", "skewed")


@dataclass(slots=True, frozen=True)
class GatewayPlan:
    """N gateway instances in front of the one fleet (see ``docs/guides/simulator.md``).

    ``spread``: how arrivals reach them -- ``round-robin`` (arrival k to gateway k mod N, as a
    load balancer), ``hash`` (every request of a tenant to gateway crc32(tenant) mod N, as a
    balancer hashing the API key) or ``skewed`` (a tenant listed in ``reach`` only reaches those
    gateway indices, taken mod N, in turn; the others reach all in turn). ``shared``: with N > 1,
    tenant state (limits, fair-share counters) goes through the shared-state protocol
    (``core.shared``) over one ``MemoryStore`` whose calls answer ``sync_delay`` virtual seconds
    later, each instance syncing ``sync_interval`` after its last sync ended; off, each instance
    keeps its own limits and counters. One gateway never uses the shared state (nothing to
    share): it is exactly the single-gateway simulator."""

    count: int = 1
    spread: Spread = "round-robin"
    reach: tuple[tuple[str, tuple[int, ...]], ...] = ()
    shared: bool = True
    sync_interval: float = 0.05
    sync_delay: float = 0.0

    @property
    def sharing(self) -> bool:
        return self.count > 1 and self.shared


FaultKind = Literal["die", "slow"]


@dataclass(slots=True, frozen=True)
class FaultPlan:
    """``die``: the replica's engine is gone from ``at`` (with everything in it) until ``until``
    (None: for good). ``slow``: its steps take ``factor`` x as long from ``at`` until ``until``."""

    replica: str
    kind: FaultKind
    at: float
    until: float | None = None
    factor: float = 1.0


@dataclass(slots=True, frozen=True)
class SimSetup:
    cfg: QosConfig
    profile: EngineProfile
    replicas: int
    window: int
    workload: Workload
    sample_interval: float
    engine_queue: EngineQueue = "auto"
    # the engine's priority queue preempts a running seq for a waiting one of a smaller value
    # (vLLM V0's rule); False: vLLM 0.32's, which never does (``SimEngine``)
    engine_preempts: bool = True
    # the replicas one by one (heterogeneous fleets); empty: ``replicas`` x ``profile``/``window``
    fleet: tuple[ReplicaPlan, ...] = ()
    faults: tuple[FaultPlan, ...] = ()
    probe_interval: float = 1.0  # the gateway driver's default health cadence
    gateways: GatewayPlan = GatewayPlan()
    # clients that honour a refusal's Retry-After: each refused request is sent again that many
    # seconds later, up to this many times (0: clients take the refusal as final)
    retries: int = 0
    # batch jobs fed beside the workload (``batches_feed.py``), with the gateway's feed settings
    jobs: tuple[BatchPlan, ...] = ()
    batches: BatchSettings = field(default_factory=BatchSettings)
    seed: int = 0  # the jobs' retry jitter
    # each model's engine profile by name: what a ``profile`` of the config's ``models`` may
    # name besides the built-in profiles and files (``models.token_times``)
    model_profiles: tuple[tuple[str, EngineProfile], ...] = ()
    # the engine time per tenant is also measured from here to the end of the arrival span
    warmup: float = 0.0

    def plans(self) -> tuple[ReplicaPlan, ...]:
        if self.fleet:
            return self.fleet
        return tuple(
            ReplicaPlan(f"r{i}", self.profile, self.window) for i in range(self.replicas)
        )


def passthrough_config(cfg: QosConfig) -> QosConfig:
    """``cfg`` with nothing that would hold a request in qosgate under ``engine-priority``: no
    share of a window reserved for a class, no prefill budget next to realtime streams, no KV
    bound of cache-aware's (the engine's own priority queue is the whole policy there)."""
    fleet = cfg.fleet
    if "prefill_budget_tokens" in type(fleet).model_fields:
        fleet = fleet.model_copy(update={"prefill_budget_tokens": None})
    if "kv_fill" in type(fleet.cache).model_fields:
        fleet = fleet.model_copy(
            update={"cache": fleet.cache.model_copy(update={"kv_fill": None})})
    classes = tuple(
        c.model_copy(update={"reserved_share": 0.0})
        if "reserved_share" in type(c).model_fields
        else c
        for c in cfg.classes
    )
    return cfg.model_copy(update={"fleet": fleet, "classes": classes})


def scaled(profile: EngineProfile, factor: float) -> EngineProfile:
    """``profile`` with every time coefficient x ``factor``: each step lasts ``factor`` x longer."""
    if factor == 1.0:
        return profile
    return profile.model_copy(
        update={
            "step_fixed_s": profile.step_fixed_s * factor,
            "prefill_s_per_token": profile.prefill_s_per_token * factor,
            "prefill_s_per_ctx_token": profile.prefill_s_per_ctx_token * factor,
            "decode_s_per_ctx_token": profile.decode_s_per_ctx_token * factor,
            "decode_s_per_seq": profile.decode_s_per_seq * factor,
            "host_load_s_per_token": profile.host_load_s_per_token * factor,
        }
    )
