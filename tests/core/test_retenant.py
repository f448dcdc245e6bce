"""A reload's tenants (``Scheduler.retenant``): new keys and limits for the requests that
arrive from then on, the admitted ones keeping theirs; classes that differ are refused."""

from __future__ import annotations

import pytest

from qosgate.config import Tenant, TenantLimits, default_config
from qosgate.core import QosInputError, QosInputs, ReplicaSpec, Scheduler, State


def _sched(*tenants: Tenant) -> Scheduler:
    return Scheduler(default_config(tenants=list(tenants)), "qos",
                     [ReplicaSpec("r0", 8, window_mode="fixed")])


def _submit(s: Scheduler, rid: str, key: str, now: float) -> str:
    req = s.make_request(rid, QosInputs(api_key=key), now, 10, 10)
    s.submit(req, now)
    return req.state.value


def test_a_key_added_and_a_limit_lowered_apply_to_what_arrives_next() -> None:
    acme = Tenant(name="acme", api_keys=("k-acme",), weight=1.0,
                  limits=TenantLimits(max_concurrent=4))
    s = _sched(acme)
    assert _submit(s, "a1", "k-acme", 0.0) == "dispatched"
    with pytest.raises(QosInputError):
        s.make_request("n1", QosInputs(api_key="k-new"), 0.0, 10, 10)
    lowered = acme.model_copy(update={"limits": TenantLimits(max_concurrent=1), "weight": 3.0})
    newco = Tenant(name="newco", api_keys=("k-new",))
    s.retenant(default_config(tenants=[lowered, newco]), 1.0)
    assert s.requests["a1"].state is State.DISPATCHED  # admitted before: untouched
    assert _submit(s, "n1", "k-new", 1.0) == "dispatched"  # the new key serves
    assert _submit(s, "a2", "k-acme", 1.0) == "rejected"  # one at a time now: a1 holds it
    assert s.classifier.tenant_for("k-acme").weight == 3.0  # type: ignore[union-attr]
    assert s.policy.tenant_weights == {"acme": 3.0, "newco": 1.0}


def test_classes_that_differ_are_refused_and_nothing_changes() -> None:
    s = _sched(Tenant(name="acme", api_keys=("k-acme",)))
    cfg = default_config(tenants=[Tenant(name="b", api_keys=("k-b",))])
    changed = cfg.model_copy(update={"classes": tuple(
        c.model_copy(update={"weight": c.weight + 1}) for c in cfg.classes)})
    with pytest.raises(ValueError, match="classes"):
        s.retenant(changed, 0.0)
    assert s.classifier.tenant_for("k-acme") is not None
