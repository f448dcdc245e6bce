"""``GET /v1/qos/status``: queue depth, waits and in-flight per class, tenant and replica.

An admin key (or anyone, when the gateway runs open) sees everything; a tenant's key sees only
its own requests (the replica entries then count only that tenant's requests in flight).
"""

from __future__ import annotations

from typing import Any

from qosgate.core import Scheduler


def _bucket() -> dict[str, Any]:
    return {"queued": 0, "inflight": 0, "oldest_wait_s": 0.0}


def status_view(sched: Scheduler, now: float, tenant: str | None = None) -> dict[str, Any]:
    classes = {c.name: _bucket() for c in sched.classes}
    tenants: dict[str, dict[str, Any]] = {}
    for bucket in sched.queued:
        for r in bucket.values():
            if tenant is not None and r.tenant != tenant:
                continue
            wait = now - r.arrival
            for entry in (
                classes[r.service_class],
                tenants.setdefault(r.tenant, {"classes": {}, **_bucket()}),
            ):
                entry["queued"] += 1
                entry["oldest_wait_s"] = max(entry["oldest_wait_s"], wait)
            tc = tenants[r.tenant]["classes"].setdefault(r.service_class, _bucket())
            tc["queued"] += 1
            tc["oldest_wait_s"] = max(tc["oldest_wait_s"], wait)
    replicas: dict[str, dict[str, Any]] = {}
    for rep in sched.replicas.values():
        mine = [r for r in rep.inflight.values() if tenant is None or r.tenant == tenant]
        replicas[rep.name] = {"capacity": rep.capacity, "inflight": len(mine)}
        for r in mine:
            classes[r.service_class]["inflight"] += 1
            t = tenants.setdefault(r.tenant, {"classes": {}, **_bucket()})
            t["inflight"] += 1
            t["classes"].setdefault(r.service_class, _bucket())["inflight"] += 1
    view: dict[str, Any] = {
        "policy": sched.policy.name,
        "classes": classes,
        "tenants": tenants,
        "replicas": replicas,
    }
    if tenant is None:
        view["queued_total"] = sched.queued_total
        view["free_slots"] = sched.free_slots
    else:
        view["tenant"] = tenant
        tenants.setdefault(tenant, {"classes": {}, **_bucket()})
    return view
