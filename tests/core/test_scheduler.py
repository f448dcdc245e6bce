"""Unit tests of the scheduler facade, each pinning one rule with hand-built situations."""

from __future__ import annotations

import pytest

from qosgate.config import Admission, Tenant, TenantLimits, default_config
from qosgate.core import Dispatch, Finished, Preempt, QosInputs, ReplicaSpec, Scheduler, State
from tests.support.scheduler import Harness


def make(policy: str = "qos", capacity: int = 1, pausable: bool = False, **cfg: object) -> Harness:
    sched = Scheduler(
        default_config(**cfg), policy, [ReplicaSpec("r0", capacity, pausable=pausable)]
    )
    return Harness(sched)


def test_dispatch_when_free_and_complete() -> None:
    h = make()
    r = h.submit("api")
    assert r.state is State.DISPATCHED and r.replica == "r0"
    h.run_until(10)
    assert r.state is State.COMPLETED and r.first_token_at == pytest.approx(0.05)
    assert h.sched.outcomes[("api", "default", "completed", "completed")] == 1


def test_strict_realtime_goes_first_then_weighted() -> None:
    h = make(capacity=1)
    h.submit("offline")  # takes the only slot
    b = h.submit("batch")
    rt = h.submit("realtime")
    h.run_until(0.02)
    # realtime preempted the offline request that had produced nothing yet
    assert rt.state is State.DISPATCHED
    assert b.state is State.QUEUED


def test_preempt_only_before_first_token_on_a_remote_engine() -> None:
    h = make(capacity=1)
    off = h.submit("offline", output=100)
    h.run_until(0.1)  # offline has its first token: the client saw bytes
    assert off.state is State.RUNNING
    rt = h.submit("realtime")
    assert rt.state is State.QUEUED and off.state is State.RUNNING
    h.run_until(5)
    assert off.state is State.COMPLETED and rt.state is State.COMPLETED


def test_preempted_request_is_requeued_not_failed() -> None:
    h = make(capacity=1)
    off = h.submit("offline")
    decisions = h.sched.submit(
        h.sched.make_request("rt", QosInputs(qos_class="realtime"), h.now, 10, 10),
        h.now,
    )
    h.output_of["rt"] = 10
    kinds = [type(d).__name__ for d in decisions]
    assert kinds == ["Preempt", "Dispatch"]
    h.apply(decisions)
    assert off.state is State.QUEUED and off.preemptions == 1
    h.run_until(10)
    assert off.state is State.COMPLETED and h.finished[off.id] == 1


def test_pausable_engine_pauses_running_and_resumes_on_the_same_replica() -> None:
    h = make(capacity=1, pausable=True)
    off = h.submit("offline", output=100)
    h.run_until(0.2)
    assert off.state is State.RUNNING
    out = h.sched.submit(
        h.sched.make_request("rt", QosInputs(qos_class="realtime"), h.now, 10, 10),
        h.now,
    )
    pre = [d for d in out if isinstance(d, Preempt)]
    assert pre and pre[0].pause and pre[0].req is off
    h.output_of["rt"] = 10
    h.apply(out)
    assert off.state is State.QUEUED and off.replica == "r0"  # pinned: its KV lives there
    h.run_until(0.36)  # realtime: 0.05 s prefill + 10 tokens
    resumed = [d for d in h.dispatches if d.req is off]
    assert [d.resume for d in resumed] == [False, True]
    assert off.state in (State.DISPATCHED, State.RUNNING)


def test_cancel_queued_and_running() -> None:
    h = make(capacity=1)
    a = h.submit("api")
    b = h.submit("api")
    h.cancel(b.id)
    assert b.state is State.CANCELLED and b.reason == "client_disconnected"
    h.cancel(a.id)
    assert a.state is State.CANCELLED
    assert h.sched.free_slots == 1
    h.cancel(a.id)  # twice is harmless
    assert h.finished[a.id] == 1


def test_queue_timeout() -> None:
    h = make(capacity=1)
    h.submit("offline", output=100000)  # holds the slot for 1000 s
    rt = h.submit("api")
    h.run_until(59.9)
    assert rt.state is State.QUEUED
    h.run_until(60.1)
    assert rt.state is State.TIMED_OUT and rt.reason == "queue_timeout"


def test_aging_promotes_one_level_per_threshold_up_to_the_ceiling() -> None:
    h = make("priority", capacity=1)
    h.submit("api", output=10**6)  # blocks the slot for a long time
    off = h.submit("offline")
    h.run_until(59)
    assert off.level == 3
    h.run_until(61)
    assert off.level == 2 and off.promotions == 1
    h.run_until(92)
    assert off.level == 1
    h.run_until(500)
    assert off.level == 1  # api is the default ceiling: the strict realtime band stays reserved


def test_class_queue_cap() -> None:
    h = make(capacity=1)
    h.sched.classes[0] = h.sched.classes[0].model_copy(update={"max_queue": 2})
    h.submit("offline", output=10**6)
    h.submit("realtime")  # preempts offline
    a, b = h.submit("realtime"), h.submit("realtime")
    c = h.submit("realtime")
    assert (a.state, b.state) == (State.QUEUED, State.QUEUED)
    assert c.state is State.REJECTED and c.reason == "class_queue_full"
    assert c.retry_after is not None and c.retry_after >= 1


def test_global_cap_displaces_the_newest_lowest_class() -> None:
    h = make(capacity=1, admission=Admission(max_queue_total=3))
    h.submit("api", output=10**6)
    b1, b2, o1 = h.submit("batch"), h.submit("batch"), h.submit("offline")
    newcomer = h.submit("api")
    assert newcomer.state is State.QUEUED
    assert o1.state is State.REJECTED and o1.reason == "displaced"
    same = h.submit("batch")  # nothing queued below batch now: the newcomer is refused
    assert same.state is State.REJECTED and same.reason == "queue_full"
    assert b2.state is State.QUEUED and h.sched.queued_total == 3
    last = h.submit("offline")
    assert last.state is State.REJECTED and last.reason == "queue_full"
    assert b1.state is State.QUEUED


def test_deadline_infeasible_rejects_at_arrival() -> None:
    h = make(capacity=1)
    for _ in range(30):  # learn a completion rate: ~1 request / 0.15 s
        h.submit("api", output=10)
        h.run_until(h.now + 0.2)
    h.submit("api", output=10**6)  # the slot is busy from now on
    rts = [h.submit("realtime", output=10) for _ in range(40)]
    reasons = {r.reason for r in rts if r.state is State.REJECTED}
    assert reasons == {"deadline_infeasible"}
    rejected = [r for r in rts if r.state is State.REJECTED]
    assert all(r.retry_after and r.retry_after >= 1 for r in rejected)
    assert len(rejected) < 40  # the first ones were admitted


def test_a_class_back_from_idle_beside_a_served_flood_is_not_taken_for_overloaded() -> None:
    """api was served, then sent nothing for two minutes while an offline flood held the
    engine. Its own dispatch rate decayed to almost nothing for want of traffic, not because
    the engine cannot serve it: admission predicts its wait from its weighted share of what the
    classes were served together, and admits it (before, half of these were refused as
    ``overloaded``; all of them are served in a few seconds)."""
    h = Harness(Scheduler(default_config(), "qos", [ReplicaSpec("r0", 8, window_mode="fixed")]),
                prefill_s=0.05, decode_s=0.01)

    def flood() -> None:
        while len(h.sched.queued[3]) < 30:
            h.submit("offline", prompt=300, output=100)

    for _ in range(10):
        h.submit(None, prompt=100, output=20)
    h.run_until(5.0)
    while h.now < 120:
        flood()
        h.run_until(h.events[0][0])
    back = []
    for _ in range(20):
        back.append(h.submit(None, prompt=100, output=20))
        h.run_until(h.now + 0.1)
        flood()
    h.run_until(h.now + 30)
    assert all(r.state is State.COMPLETED for r in back), [r.reason for r in back]
    assert max(r.first_token_at - r.arrival for r in back) < 10  # type: ignore[operator]


def test_tenant_rate_limits_and_release() -> None:
    tenants = (
        Tenant(
            name="t",
            api_keys=("k",),
            limits=TenantLimits(requests_per_minute=2, max_concurrent=1),
        ),
    )
    h = make(capacity=4, tenants=tenants)
    a = h.submit("api", "k")
    b = h.submit("api", "k")
    assert b.state is State.REJECTED and b.reason == "concurrency_limit"
    h.run_until(5)
    assert a.state is State.COMPLETED
    c = h.submit("api", "k")
    h.run_until(10)
    d = h.submit("api", "k")
    assert c.state is State.COMPLETED
    assert d.state is State.REJECTED and d.reason == "rate_limit_requests"
    # bucket of 2 refilling 1 per 30 s: 1 left at t=0, 1.17 at t=5 (c takes 1), 0.33 at t=10
    assert d.retry_after == pytest.approx(20.0)


def test_first_token_after_preempt_is_ignored() -> None:
    h = make(capacity=1)
    off = h.submit("offline")
    h.submit("realtime")
    assert off.state is State.QUEUED
    assert h.sched.first_token(off.id, h.now) == []
    assert off.state is State.QUEUED


def test_usage_correction_on_completion() -> None:
    h = make(capacity=1)
    r = h.submit("api", prompt=100, output=7, max_tokens=500)
    h.run_until(10)
    assert r.output_tokens == 7 and r.state is State.COMPLETED


def test_every_decision_kind_names_its_request() -> None:
    h = make(capacity=1)
    h.submit("offline")
    out = h.sched.submit(
        h.sched.make_request("x", QosInputs(qos_class="realtime"), 0, 1, 1),
        0,
    )
    assert all(isinstance(d, Dispatch | Preempt | Finished) and d.req for d in out)


def test_pausable_engine_pauses_even_before_the_first_token() -> None:
    """In-process engines keep a partial prefill: pausing it loses no work, aborting would."""
    h = make(capacity=1, pausable=True)
    off = h.submit("offline", prompt=5000, output=100)
    out = h.sched.submit(h.sched.make_request("rt", QosInputs(qos_class="realtime"), 0, 10, 10), 0)
    pre = [d for d in out if isinstance(d, Preempt)]
    assert len(pre) == 1 and pre[0].req is off and pre[0].pause
    assert off.state is State.QUEUED and off.replica == "r0"


def test_reject_queued_for_shutdown_leaves_running_alone() -> None:
    h = make(capacity=1)
    running = h.submit("api")
    queued = [h.submit("batch"), h.submit("offline")]
    h.apply(h.sched.reject_queued(h.now))
    assert all(r.state is State.REJECTED and r.reason == "shutting_down" for r in queued)
    assert all(r.retry_after is not None for r in queued)
    assert running.state is State.DISPATCHED
    h.run_until(10)
    assert running.state is State.COMPLETED


def test_completion_rate_is_unbiased_while_warming_up() -> None:
    from qosgate.core.admission import DecayingRate

    rate = DecayingRate(tau=10.0)
    for i in range(20):  # 10 completions per second for 2 s: far less than tau
        rate.add(i * 0.1)
    assert rate.value(1.9) == pytest.approx(10.0, rel=0.1)
    steady = DecayingRate(tau=10.0)
    for i in range(1000):
        steady.add(i * 0.1)
    assert steady.value(99.9) == pytest.approx(10.0, rel=0.05)
    assert DecayingRate().value(5.0) == 0.0  # nothing seen: nothing known


def test_deadline_admission_counts_preemptible_slots_as_room() -> None:
    """A realtime request is not refused as infeasible while it could preempt its way in."""
    h = make(capacity=1, pausable=True)
    for _ in range(10):  # learn a slow completion rate: one per 2.5 s
        h.submit("api", output=10)
        h.run_until(h.now + 2.5)
    off = h.submit("offline", output=10**5)
    h.run_until(h.now + 1)
    assert off.state is State.RUNNING
    rt = h.submit("realtime", output=10)
    assert rt.state is State.DISPATCHED and off.state is State.QUEUED


def test_reject_queued_spares_a_paused_stream_which_then_finishes() -> None:
    h = make(capacity=1, pausable=True)
    off = h.submit("offline", output=50)
    h.run_until(0.2)  # offline streams
    rt = h.submit("realtime", output=10)  # pauses it
    waiting = h.submit("batch")
    assert off.state is State.QUEUED and rt.state is State.DISPATCHED
    h.apply(h.sched.reject_queued(h.now))
    assert waiting.state is State.REJECTED and off.state is State.QUEUED
    h.run_until(10)
    assert rt.state is State.COMPLETED and off.state is State.COMPLETED


def test_a_metrics_snapshot_counts_tenants_without_walking_the_queue() -> None:
    tenants = (Tenant(name="a", api_keys=("ka",)), Tenant(name="b", api_keys=("kb",)))
    h = make(capacity=1, tenants=tenants)
    h.submit("api", tenant_key="ka", output=10**6)  # takes the slot
    for key, cls in [("ka", "api"), ("ka", "api"), ("kb", "api"), ("kb", "batch")]:
        h.submit(cls, tenant_key=key)
    h.run_until(3.0)
    full = h.sched.snapshot(h.now, tenants=True)
    counts = h.sched.snapshot(h.now, tenants=True, tenant_waits=False)
    rows = {(r.tenant, r.service_class): (r.queued, r.inflight) for r in counts.tenants}
    assert rows == {(r.tenant, r.service_class): (r.queued, r.inflight) for r in full.tenants}
    assert rows == {("a", "api"): (2, 1), ("b", "api"): (1, 0), ("b", "batch"): (1, 0)}
    assert all(r.oldest_wait_s == 0 for r in counts.tenants)
    assert max(r.oldest_wait_s for r in full.tenants) == pytest.approx(3.0)


# ---------------------------------------------------------------- the output cap
def _with_ceilings(batch: int | None = None, tenant: int | None = None) -> Scheduler:
    from qosgate.config import _default_classes

    classes = [c.model_copy(update={"max_output_tokens": batch}) if c.name == "batch" else c
               for c in _default_classes()]
    tenants = [Tenant(name="t", api_keys=("k",), limits=TenantLimits(
        tokens_per_minute=6000, max_output_tokens=tenant))]
    return Scheduler(default_config(classes=classes, tenants=tenants), "qos",
                     [ReplicaSpec("r0", 4)])


def test_no_cap_is_bounded_by_the_context_and_charged_the_class_estimate() -> None:
    s = _with_ceilings()
    req = s.make_request("a", QosInputs(api_key="k", qos_class="api"), 0, 900, None,
                         context=1000)
    # the engine may run to the end of its context: that is the bound ...
    assert req.max_tokens == 100 and req.ceiling is None
    # ... but admission charges what the class usually produces (256 before it has learned)
    assert req.est_output_tokens == 100
    wide = s.make_request("b", QosInputs(api_key="k", qos_class="api"), 0, 10, None,
                          context=100_000)
    assert wide.max_tokens == s.cfg.admission.max_output_tokens
    assert wide.est_output_tokens == 256
    unknown = s.make_request("c", QosInputs(api_key="k", qos_class="api"), 0, 10, None)
    assert unknown.max_tokens == s.cfg.admission.max_output_tokens


def test_no_cap_cannot_dodge_the_token_limit() -> None:
    """Charged an estimate at admission, a request without a cap pays its real usage when it
    ends: a tenant that keeps sending uncapped long answers runs out of tokens as one whose
    requests said so up front."""
    s = _with_ceilings()
    now = 0.0
    served = 0
    for i in range(10):
        req = s.make_request(f"r{i}", QosInputs(api_key="k", qos_class="api"), now, 10, None)
        out = s.submit(req, now)
        if not any(isinstance(d, Dispatch) for d in out):
            break
        s.first_byte(req.id, now)
        s.complete(req.id, now, 3000)  # each answer is 3000 tokens, far over the estimate
        served += 1
    # 6000 tokens a minute: the third uncapped request finds the tenant in debt
    assert served == 2


def test_ceilings_class_and_tenant() -> None:
    s = _with_ceilings(batch=40, tenant=20)
    req = s.make_request("a", QosInputs(api_key="k", qos_class="batch"), 0, 10, None)
    assert req.ceiling == 20 and req.max_tokens == 20  # the smaller of the two, inserted
    over = s.make_request("b", QosInputs(api_key="k", qos_class="batch"), 0, 10, 21)
    out = s.submit(over, 0)
    assert over.state is State.REJECTED and over.reason == "invalid_max_tokens", out
    s2 = _with_ceilings(batch=40)
    assert s2.make_request("c", QosInputs(api_key="k", qos_class="batch"), 0, 10,
                           None).ceiling == 40
    assert s2.make_request("d", QosInputs(api_key="k", qos_class="api"), 0, 10,
                           None).ceiling is None
