"""The scheduler's owned parts, asked directly: admission's verdicts, the timers' order, the
fleet's placement answers, the reasons' helpers and the factory tables. Each part answers and
changes no request (only the scheduler does), so a query can be asked twice with one answer."""

from __future__ import annotations

import math

import pytest

from qosgate.config import Admission as AdmissionConfig
from qosgate.config import Aging, Fleet, Window, default_config
from qosgate.core import QosInputs, ReplicaSpec, Request, Scheduler, State
from qosgate.core.admission import Displace, Refusal
from qosgate.core.breakers import AlwaysClosed, OutlierDetector, build_breaker
from qosgate.core.queueing import POLICIES, POLICY_NAMES, build_policy
from qosgate.core.reasons import Reason, is_timeout, upstream, upstream_status
from qosgate.core.routing import ROUTERS, build_router
from qosgate.core.timers import Timers
from qosgate.core.tpot_guard import FixedGuard, LearnedGuard, build_guard
from qosgate.core.windows import WINDOW_RULES, AdaptiveWindow, FixedWindow, build_window


def _sched(capacity: int = 1, policy: str = "qos", **cfg: object) -> Scheduler:
    return Scheduler(default_config(**cfg), policy,
                     [ReplicaSpec("r0", capacity, window_mode="fixed")])


def _req(s: Scheduler, rid: str, cls: str = "api", now: float = 0.0, prompt: int = 10,
         max_tokens: int = 100, model: str = "") -> Request:
    return s.make_request(rid, QosInputs(qos_class=cls), now, prompt, max_tokens, model)


# ---------------------------------------------------------------- admission
def test_admission_admits_with_none_and_refuses_bad_requests_without_changing_them() -> None:
    s = _sched(admission=AdmissionConfig(max_prompt_tokens=100))
    lim = s._limiter("default", 0.0)
    ok = _req(s, "ok")
    assert s.admission.verdict(ok, lim, 0.0) is None  # admit: nothing built
    long = _req(s, "long", prompt=101)
    v = s.admission.verdict(long, lim, 0.0)
    assert v == Refusal(Reason.PROMPT_TOO_LONG, None)
    assert s.admission.verdict(long, lim, 0.0) == v  # asked twice, one answer
    assert long.state is State.NEW and long.reason == ""  # the scheduler carries it out
    bad = _req(s, "bad", max_tokens=10**9)
    assert s.admission.verdict(bad, lim, 0.0) == Refusal(Reason.INVALID_MAX_TOKENS, None)


def test_admission_displaces_the_newest_of_the_lowest_class_when_the_queue_is_full() -> None:
    s = _sched(admission=AdmissionConfig(max_queue_total=3))
    s.submit(_req(s, "running", "batch"), 0.0)  # takes the one slot
    for rid, cls in (("b1", "batch"), ("o1", "offline"), ("o2", "offline")):
        s.submit(_req(s, rid, cls), 0.0)
    assert s.queued_total == 3
    lim = s._limiter("default", 0.0)
    v = s.admission.verdict(_req(s, "api"), lim, 0.0)
    assert isinstance(v, Displace) and v.victim.id == "o2" and v.retry_after >= 1.0
    assert v.victim.state is State.QUEUED  # still queued: the verdict changed nothing
    # the lowest class may displace no one: refused
    v = s.admission.verdict(_req(s, "off", "offline"), lim, 0.0)
    assert isinstance(v, Refusal) and v.reason == Reason.QUEUE_FULL
    # carried out by the scheduler: the victim ends displaced, the newcomer queues
    out = s.submit(_req(s, "api2"), 0.0)
    assert [d.req.id for d in out] == ["o2"] and s.requests["api2"].state is State.QUEUED
    assert s.outcomes[("offline", "default", "rejected", "displaced")] == 1


def test_a_policy_blind_to_classes_displaces_no_one() -> None:
    s = _sched(policy="fifo", admission=AdmissionConfig(max_queue_total=1))
    s.submit(_req(s, "running", "batch"), 0.0)
    s.submit(_req(s, "o1", "offline"), 0.0)
    v = s.admission.verdict(_req(s, "rt", "realtime"), s._limiter("default", 0.0), 0.0)
    assert isinstance(v, Refusal) and v.reason == Reason.QUEUE_FULL


def test_predicted_wait_is_zero_beside_free_room_and_unknown_without_a_rate() -> None:
    s = _sched(capacity=2)
    assert s.admission.predicted_wait(1, 0.0) == 0.0  # free room, nothing queued
    for i in range(4):
        s.submit(_req(s, f"r{i}"), 0.0)
    assert s.admission.predicted_wait(1, 0.0) is None  # a queue, and no completion rate yet


# ---------------------------------------------------------------- timers
def test_timers_pop_due_in_time_order_and_skip_stale_ones() -> None:
    cfg = default_config()
    classes = list(cfg.classes)
    timers = Timers(classes, aging=False, ceiling=0)
    reqs = []
    for i, when in enumerate((3.0, 1.0, 2.0)):
        r = Request(f"t{i}", "t", "api", 1, 0.0, 10.0, 1, 1)
        r.move(State.QUEUED)
        r.expires_at = when
        timers.arm(r, queued=3)
        reqs.append(r)
    assert timers.next_at() == 1.0
    assert timers.pop_due(0.5) is None  # nothing due yet
    reqs[2].move(State.DISPATCHED)  # its timer (2.0) is stale now
    got = []
    while (due := timers.pop_due(5.0)) is not None:
        got.append(due.id)
    assert got == ["t1", "t0"]
    assert timers.next_at() is None


def test_timers_age_only_below_the_ceiling_and_only_when_on() -> None:
    cfg = default_config(aging=Aging(enabled=True))
    classes = list(cfg.classes)
    batch = next(c for c in classes if c.name == "batch")
    r = Request("a", "t", "batch", batch.level, 0.0, 10.0, 1, 1)
    on = Timers(classes, aging=True, ceiling=1)
    assert on.expiry(r, 5.0) == 5.0 + batch.queue_timeout_s
    expected = math.inf if batch.aging_after_s is None else 5.0 + batch.aging_after_s
    assert on.ages_at(r, 5.0) == expected
    assert Timers(classes, aging=False, ceiling=1).ages_at(r, 5.0) == math.inf
    assert Timers(classes, aging=True, ceiling=batch.level).ages_at(r, 5.0) == math.inf


# ---------------------------------------------------------------- fleet
def test_fleet_answers_placement_queries_without_placing() -> None:
    s = Scheduler(default_config(fleet=Fleet(router="most-free")), "qos",
                  [ReplicaSpec("a", 1, window_mode="fixed", models=("m",)),
                   ReplicaSpec("b", 2, window_mode="fixed")])
    fleet = s.fleet
    req = _req(s, "x", model="m")
    assert fleet.choose(req, 0.0) is s.replicas["b"]  # the most free that serves m
    assert fleet.choose(req, 0.0) is s.replicas["b"] and fleet.free_slots == 3  # no change
    other = _req(s, "y", model="other")
    assert not fleet.may_take(s.replicas["a"], other, 0.0)
    assert fleet.may_take(s.replicas["b"], other, 0.0)
    assert fleet.preemption_victim(_req(s, "rt", "realtime"), 0.0) is None  # nothing in flight


def test_fleet_names_the_least_urgent_latest_preemptible_victim() -> None:
    s = _sched(capacity=3)
    for rid, cls, now in (("b1", "batch", 0.0), ("o1", "offline", 1.0), ("o2", "offline", 2.0)):
        s.submit(_req(s, rid, cls, now=now), now)
    victim = s.fleet.preemption_victim(_req(s, "rt", "realtime", now=3.0), 3.0)
    assert victim is not None and victim.id == "o2"
    assert s.fleet.preemptible_below(1) == 3 and s.fleet.preemptible_below(2) == 2


# ---------------------------------------------------------------- reasons
def test_reasons_keep_their_strings_and_read_their_data() -> None:
    assert str(Reason.QUEUE_TIMEOUT) == "queue_timeout" and f"{Reason.DISPLACED}" == "displaced"
    labels: dict[str, int] = {Reason.COMPLETED: 1}
    assert labels.get("completed") == 1  # the same label key either way
    assert is_timeout("first_byte_timeout") and is_timeout(Reason.QUEUE_TIMEOUT)
    assert not is_timeout("upstream_500")
    assert upstream(503) == "upstream_503" and upstream_status(upstream(503)) == 503
    assert upstream_status("upstream_unreachable") is None
    assert upstream_status("completed") is None


# ---------------------------------------------------------------- one construction style
def test_every_family_is_built_by_name_from_a_table() -> None:
    cfg = default_config()
    assert POLICY_NAMES == tuple(POLICIES) == ("fifo", "priority", "wfq", "qos")
    assert [build_policy(cfg, n).tenant_fair for n in POLICY_NAMES] == [False, False, False, True]
    assert {build_router(n).name for n in ROUTERS} == set(ROUTERS)
    fixed, adaptive = build_window("fixed", 8, Window()), build_window("adaptive", 8, Window())
    assert isinstance(fixed, FixedWindow) and not fixed.adaptive and fixed.window == 8
    assert isinstance(adaptive, AdaptiveWindow) and adaptive.adaptive
    assert set(WINDOW_RULES) == {"adaptive", "fixed"}
    assert isinstance(build_guard("auto"), LearnedGuard)
    assert isinstance(build_guard(0.6), FixedGuard)
    assert isinstance(build_breaker(cfg.fleet.outlier, 0), (AlwaysClosed, OutlierDetector))
    for build, bad in ((lambda: build_policy(cfg, "nope"), "policy"),
                       (lambda: build_router("nope"), "router"),
                       (lambda: build_window("nope", 1, Window()), "window mode")):
        with pytest.raises(ValueError, match=bad):
            build()
