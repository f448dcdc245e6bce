"""``GET /v1/qos/status``: queue depth, waits and in-flight per class, tenant and replica.

Built from the core's frozen ``snapshot``. An admin key (or anyone, when the gateway runs open)
sees everything; a tenant's key sees only its own requests (the replica entries then count only
that tenant's requests in flight, and say nothing of the fleet's health) and what is left of its
limits (``allowance``). Each tenant's ``models`` say what it used of each model (requests,
tokens) and what it was charged for it, in reference-model tokens (``core.weights``); the
top-level ``models`` give each weighted model's weight and where it comes from.
"""

from __future__ import annotations

from typing import Any

from qosgate.core import Scheduler
from qosgate.core.snapshot import Snapshot
from qosgate.runtime.batches.records import BatchRecord
from qosgate.server.allowance import allowance_view


def _bucket() -> dict[str, Any]:
    return {"queued": 0, "inflight": 0, "oldest_wait_s": 0.0}


def _add(entry: dict[str, Any], queued: int, inflight: int, oldest: float) -> None:
    entry["queued"] += queued
    entry["inflight"] += inflight
    entry["oldest_wait_s"] = max(entry["oldest_wait_s"], oldest)


def status_view(sched: Scheduler, now: float, tenant: str | None = None) -> dict[str, Any]:
    snap: Snapshot = sched.snapshot(now, tenants=True)
    classes = {c.name: _bucket() for c in snap.classes}
    tenants: dict[str, dict[str, Any]] = {}
    for row in snap.tenants:
        if tenant is not None and row.tenant != tenant:
            continue
        t = tenants.setdefault(row.tenant, {"classes": {}, **_bucket()})
        for entry in (classes[row.service_class], t,
                      t["classes"].setdefault(row.service_class, _bucket())):
            _add(entry, row.queued, row.inflight, row.oldest_wait_s)
    for u in snap.usage:
        if tenant is not None and u.tenant != tenant:
            continue
        t = tenants.setdefault(u.tenant, {"classes": {}, **_bucket()})
        t.setdefault("models", {})[u.model] = {
            "requests": u.requests,
            "prompt_tokens": u.prompt_tokens,
            "output_tokens": u.output_tokens,
            "charged": round(u.charged, 3),
        }
    replicas: dict[str, dict[str, Any]] = {}
    for r in snap.replicas:
        if tenant is None:
            replicas[r.name] = {
                "capacity": r.window,
                "inflight": r.inflight,
                "models": list(r.models),
                "adapters": list(r.adapters),
                "up": r.up,
                "eligible": r.eligible,
                "retired": r.retired,
                "breaker": r.breaker,
                "ejections": r.ejections,
                "cooling_s": round(r.cooling_s, 3),
            }
        else:
            replicas[r.name] = {"inflight": 0}
    if tenant is not None:
        for name, who, n in snap.replica_tenants:
            if who == tenant:
                replicas[name]["inflight"] = n
    view: dict[str, Any] = {
        "policy": snap.policy,
        "classes": classes,
        "tenants": tenants,
        "replicas": replicas,
        "charged_unit": "reference-model tokens",
        "models": {name: dict(w) for name, w in snap.model_weights.items()},
    }
    if tenant is None:
        view["queued_total"] = snap.queued_total
        view["free_slots"] = snap.free_slots
    else:
        view["tenant"] = tenant
        view["allowance"] = allowance_view(sched.allowance(tenant, now))
        view["model_allowance"] = {m: allowance_view(sched.allowance(tenant, now, m))
                                   for m in sched.limited_models(tenant)}
        tenants.setdefault(tenant, {"classes": {}, **_bucket()})
    return view


def jobs_view(live: list[BatchRecord], in_flight: dict[str, int],
              tenant: str | None = None) -> list[dict[str, Any]]:
    """The batch jobs not ended, by deadline (a tenant's key: its own only), with the lines
    this instance has in flight for each."""
    return [
        {
            "id": r.id,
            "tenant": r.tenant,
            "status": r.status,
            "class": r.qos_class,
            "endpoint": r.endpoint,
            "total": r.total,
            "completed": r.completed,
            "failed": r.failed,
            "in_flight": in_flight.get(r.id, 0),
            "created_at": r.created_at,
            "expires_at": r.expires_at,
        }
        for r in live if tenant is None or r.tenant == tenant
    ]
