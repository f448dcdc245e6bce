"""A frozen read model of the scheduler: what ``/metrics``, ``/v1/qos/status`` and the simulator
read, instead of walking the scheduler's live objects.

``Scheduler.snapshot(now)`` builds one in O(classes + replicas + in flight); the per-tenant rows
(``tenants=True``) walk the queued requests too, so a scrape asks for them only where it needs
them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from qosgate.core.signals import LoadSignals
from qosgate.core.usage import UsageRow


@dataclass(frozen=True, slots=True)
class ClassView:
    name: str
    queued: int
    inflight: int
    oldest_wait_s: float  # of the request queued longest (0 when none is)


@dataclass(frozen=True, slots=True)
class TenantView:
    tenant: str
    service_class: str
    queued: int
    inflight: int
    oldest_wait_s: float


@dataclass(frozen=True, slots=True)
class ReplicaView:
    name: str
    models: tuple[str, ...]
    window: int
    inflight: int
    up: bool
    eligible: bool  # may take new work now
    breaker: str  # closed | open (ejected)
    ejections: int
    cooling_s: float  # back-pressure left, seconds (0 when not cooling)
    signals: LoadSignals | None
    engine_itl_s: float | None = None  # the engine's mean time per token between two scrapes
    others_held: bool = False  # the TPOT guard holds the non-strict classes off it
    tpot_guard_s: float | None = None  # the time per token past which it would (None: no guard)
    retired: bool = False  # taken out of the config by a reload: no new work
    adapters: tuple[str, ...] = ()  # LoRA adapters its engine is taken to hold now


@dataclass(frozen=True, slots=True)
class Snapshot:
    at: float
    policy: str
    queued_total: int
    free_slots: int
    classes: tuple[ClassView, ...]
    replicas: tuple[ReplicaView, ...]
    tenants: tuple[TenantView, ...]  # empty unless asked for
    replica_tenants: tuple[tuple[str, str, int], ...]  # (replica, tenant, in flight) if asked
    preemptions: tuple[tuple[str, int], ...]  # (class, count)
    attempt_failures: tuple[tuple[str, str, str, int], ...]  # (class, replica, reason, count)
    retries: tuple[tuple[str, str, str, int], ...]  # (class, replica, reason, count)
    overtakes: tuple[tuple[str, int], ...] = ()  # (replica, dispatches past a full window)
    evictions: tuple[tuple[str, int], ...] = ()  # (class, streams evicted after a first byte)
    moves: tuple[tuple[str, str, int], ...] = ()  # (class, reason, streams moved mid-stream)
    resumes: tuple[tuple[str, int], ...] = ()  # (class, streams continued by a new call)
    # (class, prompt tokens sent again to continue streams, of those the engine had cached)
    resent: tuple[tuple[str, int, int], ...] = ()
    # deadline admission per class: (class, admitted requests whose TTFT was seen, of those on
    # time, the factor forecasts are multiplied by now)
    calibration: tuple[tuple[str, int, int, float], ...] = ()
    # refusals' bookings (``core.bookings``): made, taken by their returns, lapsed
    bookings: tuple[int, int, int] = (0, 0, 0)
    # per (tenant, model), with the tenant rows: requests, tokens and the charged cost
    usage: tuple[UsageRow, ...] = ()
    # each weighted model's weight, its source (configured, profile, learned) and load cost
    model_weights: Mapping[str, Mapping[str, float | str]] = field(default_factory=dict)
