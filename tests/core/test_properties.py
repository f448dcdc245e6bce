"""Property tests: the scheduler's invariants under generated workloads.

The harness checks after every event: no request dispatched twice at once, nothing ends twice,
the queue/in-flight books balance, nothing waits while a slot is free, and (for the strict-band
policies) no lower band is dispatched while realtime waits.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from qosgate.config import (
    Admission,
    Aging,
    Fairness,
    Fleet,
    Tenant,
    TenantLimits,
    default_config,
)
from qosgate.core import POLICY_NAMES, QosInputs, ReplicaSpec, Scheduler, State
from qosgate.core.prefix import Prefix
from qosgate.core.signals import LoadSignals
from tests.support.classes import admitted_on_queue_time, with_reserve
from tests.support.scheduler import Harness


def _fixed(name: str, capacity: int, **kw: object) -> ReplicaSpec:
    """A replica whose window is its capacity: these properties are about the queues."""
    return ReplicaSpec(name, capacity, window_mode="fixed", **kw)  # type: ignore[arg-type]

CLASSES = ["realtime", "api", "batch", "offline"]

op = st.one_of(
    st.tuples(
        st.just("submit"),
        st.integers(0, 3),  # class
        st.integers(0, 2),  # tenant
        st.integers(1, 2000),  # prompt tokens
        st.integers(1, 400),  # output tokens
    ),
    st.tuples(st.just("advance"), st.floats(0.0, 5.0)),
    st.tuples(st.just("cancel"), st.integers(0, 10_000)),
    st.tuples(st.just("capacity"), st.integers(0, 4)),
)


def _config(policy: str) -> object:
    return default_config(
        policy=policy,
        tenants=(
            Tenant(name="a", api_keys=("ka",), tier="enterprise"),
            Tenant(name="b", api_keys=("kb",), limits=TenantLimits(requests_per_minute=30)),
            Tenant(
                name="c",
                api_keys=("kc",),
                tier="free",
                limits=TenantLimits(tokens_per_minute=20_000, max_concurrent=3),
            ),
        ),
        admission=Admission(max_queue_total=25, max_prompt_tokens=1800),
    )


@pytest.mark.parametrize("policy", POLICY_NAMES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op, min_size=1, max_size=120))
def test_every_request_ends_exactly_once_and_books_balance(
    policy: str, ops: list[tuple[object, ...]]
) -> None:
    sched = Scheduler(
        _config(policy),  # type: ignore[arg-type]
        policy,
        # r0's engine runs its queue in the order sent: requests may overtake there
        [_fixed("r0", 2, ordered=True), _fixed("r1", 1, pausable=True)],
    )
    h = Harness(sched)
    keys = ["ka", "kb", "kc"]
    for o in ops:
        if o[0] == "submit":
            _, c, t, prompt, output = o
            h.submit(CLASSES[c], keys[t], prompt=prompt, output=output)  # type: ignore[index]
        elif o[0] == "advance":
            h.run_until(h.now + o[1])  # type: ignore[operator]
        elif o[0] == "cancel" and h.ids:
            h.cancel(f"q{o[1] % h.ids + 1}")  # type: ignore[operator]
        elif o[0] == "capacity":
            h.apply(sched.set_window("r0", o[1], h.now))  # type: ignore[arg-type]
    h.apply(sched.set_window("r0", 2, h.now))
    h.run_until(h.now + 10_000)  # everything ends: completed or timed out at the latest
    assert not sched.requests and sched.queued_total == 0
    assert all(h.finished[f"q{i}"] == 1 for i in range(1, h.ids + 1))
    assert sum(sched.outcomes.values()) == h.ids
    states = Counter(r.state for r in h.outcomes.values())
    assert set(states) <= {State.COMPLETED, State.REJECTED, State.TIMED_OUT, State.CANCELLED}


def _saturated_run(
    policy: str, seed: int, completions: int, tenants: int = 1, capacity: int = 8,
    rules: bool = False,
) -> tuple[Harness, Counter[str], Counter[str]]:
    """Keep api, batch and offline backlogged; return service (prompt+output tokens) per class
    and per tenant over the completed requests. With ``rules``, every rule that can keep room
    from the queue is in play: a realtime stream beside them, realtime's reserve (a quarter of
    the window), the prefill budget, and a TPOT guard whose engine readings swing across its
    hold point."""
    rng = random.Random(seed)
    extra: dict[str, object] = {}
    if rules:
        extra = {"classes": with_reserve(0.25),
                 "fleet": Fleet(prefill_budget_tokens=600, tpot_guard=0.5)}
    cfg = default_config(
        policy=policy,
        fairness=Fairness(prompt_weight=1, output_weight=1),
        tenants=tuple(Tenant(name=f"t{i}", api_keys=(f"k{i}",)) for i in range(tenants)),
        **extra,  # type: ignore[arg-type]
    )
    h = Harness(Scheduler(cfg, policy, [_fixed("r0", capacity)]), prefill_s=0.01,
                decode_s=0.002)
    service: Counter[str] = Counter()
    per_tenant: Counter[str] = Counter()
    done = 0
    next_rt = next_scrape = 0.0
    itl = [0.0, 0]
    while done < completions:
        if rules and h.now >= next_rt:
            h.submit("realtime", "k0", prompt=rng.randint(10, 200), output=rng.randint(20, 100))
            next_rt = h.now + rng.uniform(0.05, 0.3)
        if rules and h.now >= next_scrape:  # the engine's time per token: 150 ms, then 30 ms
            tokens = 100
            itl[0] += tokens * (0.15 if int(h.now) % 2 else 0.03)
            itl[1] += tokens
            h.apply(h.sched.observe("r0", h.now, signals=LoadSignals(
                at=h.now, itl_seconds_total=itl[0], itl_tokens_total=itl[1])))
            next_scrape = h.now + 0.25
        for cls in ("api", "batch", "offline"):
            for t in range(tenants):
                while (
                    sum(
                        1
                        for r in h.sched.queued[CLASSES.index(cls)].values()
                        if r.tenant == f"t{t}"
                    )
                    < 6
                ):
                    out = rng.randint(1, 300)
                    req = h.submit(
                        cls,
                        f"k{t}",
                        prompt=rng.randint(10, 500),
                        output=out,
                        max_tokens=min(4096, out * rng.randint(1, 4)),
                    )
                    # six queued per class is no overload: a refusal here is a class that
                    # others overtook taken for an overloaded one
                    assert req.state is not State.REJECTED, (cls, req.reason, service)
        before = len(h.outcomes)
        h.run_until(min([h.events[0][0]] + ([next_rt, next_scrape] if rules else [])))
        for rid in list(h.outcomes)[before:]:
            r = h.outcomes[rid]
            if r.state is State.COMPLETED and r.service_class != "realtime":
                done += 1
                service[r.service_class] += r.prompt_tokens + r.output_tokens
                per_tenant[r.tenant] += r.prompt_tokens + r.output_tokens
    return h, service, per_tenant


@pytest.mark.slow
@pytest.mark.parametrize(("policy", "capacity", "rules"), [
    ("qos", 8, False), ("wfq", 8, False),
    # realtime's reserve (10% of 16: one slot), then every rule at once (a quarter of 12)
    ("qos", 16, False), ("wfq", 16, False), ("qos", 12, True), ("wfq", 12, True),
])
@settings(max_examples=4, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_weighted_shares_hold_under_saturation(
    policy: str, capacity: int, rules: bool, seed: int
) -> None:
    """api, batch and offline backlogged get 5:3:2 of the service (in tokens), whatever rule
    keeps room from the queue beside them: none of them may shift service between the
    classes (the reserve once lent only to batch and offline starved api behind them). The
    harness checks the policy's order at every fill meanwhile."""
    _, service, _ = _saturated_run(policy, seed, completions=4000, capacity=capacity,
                                   rules=rules)
    total = sum(service.values())
    for cls, want in (("api", 0.5), ("batch", 0.3), ("offline", 0.2)):
        got = service[cls] / total
        assert abs(got - want) <= 0.05 * want, f"{cls}: {got:.3f} vs {want} ({service})"


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    sizes_a=st.tuples(st.integers(1, 2000), st.integers(1, 500)),
    sizes_b=st.tuples(st.integers(1, 2000), st.integers(1, 500)),
)
def test_vtc_service_gap_between_backlogged_tenants_is_bounded(
    seed: int, sizes_a: tuple[int, int], sizes_b: tuple[int, int]
) -> None:
    """Two equal-weight tenants in one class, both backlogged with different request sizes (and
    output estimates that are off): the service gap stays within 2x the largest request cost
    (VTC). qosgate charges the estimate at dispatch and corrects it with the real usage at
    completion (VTC charges per generated token, which a gateway cannot see in advance), so a
    request's cost is the larger of what was charged and what was used."""
    rng = random.Random(seed)
    cfg = default_config(
        tenants=(Tenant(name="a", api_keys=("ka",)), Tenant(name="b", api_keys=("kb",))),
        aging=Aging(enabled=False),
    )
    h = Harness(Scheduler(cfg, "qos", [_fixed("r0", 1)]), prefill_s=0.0, decode_s=0.001)
    served = {"ka": 0, "kb": 0}
    largest = 0.0
    done = 0
    while done < 600:
        for key, (pmax, omax) in (("ka", sizes_a), ("kb", sizes_b)):
            while sum(1 for r in h.sched.requests.values() if r.tenant == key[1]) < 4:
                p, o = rng.randint(1, pmax), rng.randint(1, omax)
                req = h.submit("api", key, prompt=p, output=o, max_tokens=min(4096, o * 3))
                largest = max(largest, p + 2.0 * o, req.cost)
        before = len(h.outcomes)
        h.run_until(h.events[0][0])
        for rid in list(h.outcomes)[before:]:
            r = h.outcomes[rid]
            served["k" + r.tenant] += r.prompt_tokens + 2 * r.output_tokens
            done += 1
        assert abs(served["ka"] - served["kb"]) <= 2 * largest, (served, largest)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["priority", "qos"])
@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), arrival=st.floats(0, 30))
def test_aging_bounds_a_low_class_wait_under_constant_high_class_load(
    policy: str, seed: int, arrival: float
) -> None:
    """api traffic alone saturates the engine for the whole run; an offline request still
    starts within its aging path (60 s to batch + 30 s to api) plus a few service times."""
    rng = random.Random(seed)
    # api's queue kept 20 deep: admitted on queue time (its TTFT budget would refuse some)
    h = Harness(
        Scheduler(default_config(classes=admitted_on_queue_time()), policy, [_fixed("r0", 2)]),
        prefill_s=0.05, decode_s=0.01,
    )
    victim = None
    while h.now < 200:
        while h.sched.queued_total < 20:
            h.submit("api", output=rng.randint(50, 150))
        if victim is None and h.now >= arrival:
            victim = h.submit("offline", output=10)
        h.run_until(h.events[0][0])
    assert victim is not None and victim.dispatched_at is not None
    wait = victim.dispatched_at - victim.arrival
    assert wait <= 60 + 30 + 5, wait
    if policy == "priority":  # strict bands: it starts only once aging has lifted it to api
        assert wait >= 90, wait


def test_without_aging_strict_priority_starves_the_low_class() -> None:
    """The control for the test above: the bound really comes from aging."""
    cfg = default_config(aging=Aging(enabled=False), classes=admitted_on_queue_time())
    h = Harness(Scheduler(cfg, "priority", [_fixed("r0", 2)]))
    h.submit("api", output=100)
    h.submit("api", output=100)
    victim = h.submit("offline", output=10)
    while h.now < 200:
        while h.sched.queued_total < 20:
            h.submit("api", output=100)
        h.run_until(h.events[0][0])
    assert victim.state is State.QUEUED and victim.dispatched_at is None


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 60),
    cancel_at=st.lists(st.integers(0, 59), max_size=30),
    policy=st.sampled_from(POLICY_NAMES),
)
def test_cancel_anywhere_leaves_a_consistent_scheduler(
    n: int, cancel_at: list[int], policy: str
) -> None:
    h = Harness(Scheduler(default_config(), policy, [_fixed("r0", 3)]))
    for i in range(n):
        h.submit(CLASSES[i % 4], output=5 + i % 7)
        if i in cancel_at:
            h.cancel(f"q{(i * 7) % (i + 1) + 1}")
        if i % 5 == 0:
            h.run_until(h.now + 0.03)
    for i in range(1, n + 1):
        h.cancel(f"q{i}")
    assert not h.sched.requests and len(h.sched.policy) == 0
    assert h.sched.free_slots == 3
    # the scheduler is still fully usable afterwards
    r = h.submit("batch")
    h.run_until(h.now + 10)
    assert r.state is State.COMPLETED


def test_qos_inputs_are_all_reachable() -> None:
    """Guard for the strategies above: every class is really produced by the classifier."""
    s = Scheduler(default_config(), "qos", [_fixed("r0", 1)])
    got = {s.make_request(c, QosInputs(qos_class=c), 0, 1, 1).service_class for c in CLASSES}
    assert got == set(CLASSES)


fleet_op = st.one_of(
    st.tuples(
        st.just("submit"),
        st.integers(0, 3),  # class
        st.integers(0, 2),  # tenant
        st.integers(1, 2000),  # prompt tokens
        st.integers(1, 400),  # output tokens
        st.sampled_from(["m1", "m2", ""]),  # model
    ),
    st.tuples(st.just("advance"), st.floats(0.0, 5.0)),
    st.tuples(st.just("cancel"), st.integers(0, 10_000)),
    st.tuples(st.just("capacity"), st.integers(0, 1), st.integers(0, 4)),
    st.tuples(
        st.just("signals"),
        st.integers(2, 3),
        st.integers(0, 6),  # engine queue
        st.floats(0.0, 1.0),  # KV use
        st.integers(0, 3),  # preemptions so far
    ),
    st.tuples(st.just("probe"), st.integers(0, 3), st.booleans()),
    st.tuples(
        st.just("fail"),
        st.integers(0, 10_000),
        st.sampled_from(["fault", "unreachable", "backpressure", "final"]),
    ),
)


@pytest.mark.parametrize("policy", POLICY_NAMES)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(fleet_op, min_size=1, max_size=150))
def test_invariants_hold_with_replicas_failing_ejected_cooled_and_retried(
    policy: str, ops: list[tuple[object, ...]]
) -> None:
    """Two models on four replicas (one pausable, one serving both); replicas go down and come
    back, windows change, attempts fail (faults that eject, back-pressure that cools, refused
    connections) and are retried: every request still ends exactly once, the books balance,
    nothing is sent to a replica that does not serve its model or may not take work, nothing
    waits while a replica that could take it has room, and (the harness) no lower class goes
    past a held higher one; with realtime's reserve, the prefill budget and a TPOT guard on."""
    _run_fleet_ops(policy, "least-load", ops, rules=True)


# a burst: that many requests alike at one instant (realtime piling onto the fleet, a batch job)
burst = st.tuples(
    st.integers(2, 16), st.integers(0, 3), st.integers(0, 2), st.integers(1, 2000),
    st.integers(1, 400), st.sampled_from(["m1", "m2", ""]),
).map(lambda b: [("submit", *b[1:])] * b[0])
long_run = st.lists(st.one_of(fleet_op.map(lambda o: [o]), burst), min_size=60,
                    max_size=200).map(lambda steps: [o for step in steps for o in step])


# the runs that found each case, minimised (they stay covered, whatever the draws)
_FOUND = {
    # lending: a borrower held while api waited, api then gone in the same fill
    "lend_after_api": (
        [('submit', 0, 0, 1, 1, 'm1')] * 6 + [('submit', 0, 2, 1, 1, 'm1')] + [('signals', 2, 0,
        0.9299956628726089, 0)] + [('submit', 0, 0, 1, 49, 'm2')] + [('submit', 0, 0, 1, 349, 'm2')]
        + [('submit', 3, 0, 1, 1, 'm2')] + [('submit', 2, 0, 1, 1, 'm1')]
    ),
    # a realtime retry waits for another replica; api takes the one it failed on
    "retry_elsewhere": (
        [('submit', 0, 0, 1, 1, 'm1')] * 8 + [('advance', 1.0)] + [('capacity', 0, 0)] + [('submit',
        0, 0, 1, 1, 'm1')] * 4 + [('submit', 0, 2, 1, 1, 'm1')] + [('fail', 1, 'fault')]
    ),
    # a paused batch resumes on a suspect replica past a realtime request
    "resume_on_suspect": (
        [('advance', 0.0)] + [('capacity', 0, 0)] + [('submit', 0, 0, 1, 1, 'm1')] * 6 + [('submit',
        2, 1, 1, 1, '')] * 5 + [('cancel', 0)] + [('capacity', 1, 3)] + [('fail', 256,
        'unreachable')] + [('submit', 0, 0, 1, 1, 'm1')]
    ),
    # a paused batch resumes where the TPOT guard holds api off
    "resume_past_guard": (
        [('signals', 3, 4, 2.225073858507e-311, 1)] + [('probe', 2, False)] + [('submit', 0, 0, 700,
        173, 'm2')] + [('signals', 3, 1, 0.75, 1)] + [('submit', 3, 0, 2, 236, 'm1')] * 2 +
        [('capacity', 1, 3)] + [('submit', 1, 0, 90, 200, 'm1')] * 7 + [('submit', 2, 0, 267, 170,
        '')] + [('advance', 4.467671295632014)]
    ),
    # a paused batch resumes in the reserve while api waits
    "resume_in_reserve": (
        [('probe', 2, False)] + [('submit', 3, 0, 2, 236, 'm1')] * 2 + [('capacity', 1, 3)] +
        [('submit', 3, 0, 757, 87, '')] + [('submit', 1, 0, 90, 200, 'm1')] * 8 + [('submit', 2, 0,
        267, 170, '')] + [('advance', 4.467671295632014)]
    ),
    # a batch request held while api waited, then, api gone in the same pass, an offline
    # retry popped after it took the reserved slot it could have borrowed
    "lent_within_the_pass": (
        [('submit', 1, 1, 834, 374, 'm1')] * 6 + [('submit', 0, 0, 95, 93, 'm1')] * 2
        + [('submit', 3, 1, 320, 206, 'm2')] * 5 + [('cancel', 214), ('advance', 1.765509736265696),
        ('submit', 3, 1, 1034, 122, 'm1'), ('submit', 2, 0, 1, 2, 'm1'),
        ('submit', 0, 0, 748, 305, 'm1'), ('fail', 595, 'fault'), ('fail', 235, 'fault')]
        + [('submit', 0, 0, 93, 367, 'm2')] * 2 + [('submit', 2, 1, 134, 400, 'm2')]
    ),
}


@pytest.mark.slow
@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(POLICY_NAMES), ops=long_run)
@example(policy="qos", ops=_FOUND["lend_after_api"])
@example(policy="qos", ops=_FOUND["retry_elsewhere"])
@example(policy="qos", ops=_FOUND["resume_on_suspect"])
@example(policy="qos", ops=_FOUND["resume_past_guard"])
@example(policy="qos", ops=_FOUND["resume_in_reserve"])
@example(policy="qos", ops=_FOUND["lent_within_the_pass"])
def test_invariants_hold_over_long_runs_with_realtime_and_every_rule(
    policy: str, ops: list[tuple[object, ...]]
) -> None:
    """The test above over long runs (60-200 steps, bursts of up to 16 alike) with realtime and
    every rule on: such runs found a batch request left beside a reserved slot it might borrow
    once api had gone in the same fill, and requests paused on a suspect replica resuming there
    past a realtime one the rule held. Derandomized: the same runs every time."""
    _run_fleet_ops(policy, "least-load", ops, rules=True)


def _chain(parent: int, blocks: range | list[int]) -> tuple[int, ...]:
    """Chained block keys (each stands for its block and all before it), as wire.prefix makes."""
    keys = []
    for b in blocks:
        parent = hash((parent, b))
        keys.append(parent)
    return tuple(keys)


BLOCK = 64
# a submit with a prompt made of a shared system prompt (one of three, 0-8 blocks) and a
# conversation's turns (one of five conversations, its first 0-12 blocks), and that
# conversation as its session (or none)
affinity_op = st.one_of(
    fleet_op,
    st.tuples(
        st.just("chat"),
        st.integers(0, 3),  # class
        st.integers(0, 2),  # tenant
        st.integers(0, 2), st.integers(0, 8),  # system prompt, its blocks
        st.integers(0, 4), st.integers(0, 12),  # conversation, its blocks so far
        st.booleans(),  # named as a session
        st.integers(1, 400),  # output tokens
        st.sampled_from(["m1", "m2", ""]),
    ),
    st.tuples(st.just("kv"), st.integers(0, 2), st.integers(0, 4), st.integers(0, 12),
              st.booleans()),  # r3's engine stored (or removed) a conversation's blocks
)


@pytest.mark.slow
@pytest.mark.parametrize("router", ["cache-aware", "session-affinity"])
@pytest.mark.parametrize("policy", ["qos", "fifo"])
@pytest.mark.parametrize("rules", [True, False])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_invariants_hold_with_the_affinity_routers(
    router: str, policy: str, rules: bool, data: st.DataObject
) -> None:
    """The same fleet and faults as above, with prompts that share leading runs of blocks
    (system prompts, conversations whose turns grow), sessions, replicas that die and restart
    (their caches lost), one replica's index following its engine's KV events, and the
    affinity routers: every invariant holds, and the harness's work-conserving check allows a
    request to wait while a slot is free only where the router holds it for its warm replica,
    within its bound, with the scheduler due to wake by then. With ``rules`` (realtime's
    reserve, the prefill budget, the TPOT guard) as the test above draws its runs; without,
    runs of at least 60 events."""
    ops = data.draw(st.lists(affinity_op, min_size=1 if rules else 60, max_size=150))
    _run_fleet_ops(policy, router, ops, rules=rules)


def _run_fleet_ops(policy: str, router: str, ops: list[tuple[object, ...]], rules: bool) -> None:
    from qosgate.config import CacheRouting, Outlier, Retries

    extra: dict[str, object] = {}
    if rules:
        extra = {"prefill_budget_tokens": 600,  # often spent: holds, and its fill shortcut
                 "tpot_guard": 0.5}  # held while the signals' time per token is past 100 ms
    cfg = default_config(
        policy=policy,
        tenants=_config(policy).tenants,  # type: ignore[attr-defined]
        admission=Admission(max_queue_total=25, max_prompt_tokens=1800),
        fleet=Fleet(outlier=Outlier(consecutive_failures=2, base_ejection_s=3.0),
                    retries=Retries(max_attempts=3, min_retries=2),
                    router=router,  # type: ignore[arg-type]
                    # a small cache (evictions) and a slow prefill (waits for warm replicas)
                    cache=CacheRouting(replica_cache_tokens=20 * BLOCK,
                                       prefill_tokens_per_s=2000.0),
                    **extra),  # type: ignore[arg-type]
        # a slot of the windows of 3 and 4 kept for realtime
        classes=with_reserve(0.34 if rules else 0.0),
    )
    names = ["r0", "r1", "r2", "r3"]
    sched = Scheduler(
        cfg,
        policy,
        [
            ReplicaSpec("r0", 2, models=("m1",), window_mode="fixed", ordered=True),
            ReplicaSpec("r1", 1, models=("m1",), pausable=True, window_mode="fixed"),
            ReplicaSpec("r2", 4, models=("m2",)),  # adaptive: its window follows signals
            ReplicaSpec("r3", 3, models=("m1", "m2"), cache_events=True),
        ],
    )
    h = Harness(sched)
    keys = ["ka", "kb", "kc"]
    itl = [0.0, 0.0]  # the engines' time per output token, summed (what the TPOT guard reads)
    for o in ops:
        kind = o[0]
        if kind == "submit":
            _, c, t, prompt, output, model = o
            h.submit(CLASSES[c], keys[t], prompt=prompt, output=output,  # type: ignore[index]
                     model=model)  # type: ignore[arg-type]
        elif kind == "chat":
            _, c, t, system, sys_blocks, conv, conv_blocks, named, output, model = o
            head = _chain(-1 - system, range(sys_blocks))  # type: ignore[operator,arg-type]
            tail = _chain(head[-1] if head else -1 - system,  # type: ignore[operator]
                          [1000 * conv + b for b in range(conv_blocks)])  # type: ignore[operator]
            prefix = Prefix(head + tail, BLOCK)
            h.submit(CLASSES[c], keys[t], prompt=max(1, prefix.tokens + 10),  # type: ignore[index]
                     output=output, model=model,  # type: ignore[arg-type]
                     prefix=prefix, session=f"s{conv}" if named else None)
        elif kind == "kv":
            _, system, conv, blocks, stored = o
            chain = _chain(-1 - system, [1000 * conv + b for b in range(blocks)])  # type: ignore[operator]
            h.apply(sched.observe_cache("r3", h.now, stored=chain if stored else (),
                                        removed=() if stored else chain))
        elif kind == "advance":
            h.run_until(h.now + o[1])  # type: ignore[operator]
        elif kind == "cancel" and h.ids:
            h.cancel(f"q{o[1] % h.ids + 1}")  # type: ignore[operator]
        elif kind == "capacity":
            h.apply(sched.set_window(names[o[1]], o[2], h.now))  # type: ignore[index,arg-type]
        elif kind == "signals":
            _, i, waiting, kv, pre = o
            itl[0] += 100 * (0.15 if kv > 0.5 else 0.03)  # type: ignore[operator]
            itl[1] += 100
            sig = LoadSignals(at=h.now, waiting=waiting, kv_usage=kv,  # type: ignore[arg-type]
                              preemptions_total=pre,  # type: ignore[arg-type]
                              itl_seconds_total=itl[0], itl_tokens_total=int(itl[1]))
            h.apply(sched.observe(names[i], h.now, signals=sig))  # type: ignore[index]
        elif kind == "probe":
            h.apply(sched.observe(names[o[1]], h.now, up=o[2]))  # type: ignore[index,arg-type]
        elif kind == "fail":
            # a running one too: after its first byte it is never retried, it fails
            dispatched = sorted(r.id for r in sched.requests.values()
                                if r.state in (State.DISPATCHED, State.RUNNING))
            if dispatched:
                rid = dispatched[o[1] % len(dispatched)]  # type: ignore[operator]
                how = {"fault": {}, "unreachable": {"unreachable": True},
                       "backpressure": {"backpressure": True, "retry_after": 2.0},
                       "final": {"retryable": False}}[o[2]]  # type: ignore[index]
                h.fail_attempt(rid, **how)
    for name in names:  # everything comes back
        h.apply(sched.observe(name, h.now, up=True))
    for name in names[:2]:
        h.apply(sched.set_window(name, 2, h.now))
    h.run_until(h.now + 10_000)  # everything ends: completed, failed or timed out
    assert not sched.requests and sched.queued_total == 0
    assert sched._retrying == 0
