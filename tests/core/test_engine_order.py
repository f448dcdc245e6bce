"""The order qosgate forwards into an engine's own queue (``core.queueing.engine_order``), and
overtaking.

An engine queues what it cannot run yet and orders that queue by the value it is sent (vLLM:
smaller first, ties by arrival). What must hold: the value follows each policy's own pick order
inside a band; a tenant returning from idle is ordered before work the engines hold unstarted;
a retry or an aged request never gets a later place than it had; and a request may go past a
full window only to overtake unstarted work in an engine that orders its queue.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.config import Tenant, default_config
from qosgate.core import POLICY_NAMES, ReplicaSpec, Request, Scheduler, State
from qosgate.core.queueing import build_policy
from qosgate.core.queueing.engine_order import STRIDE, band_of, order_value
from tests.support.classes import admitted_on_queue_time, with_reserve
from tests.support.scheduler import Harness

TENANTS = (
    Tenant(name="a", api_keys=("ka",), weight=1.0),
    Tenant(name="b", api_keys=("kb",), weight=2.0),
    Tenant(name="c", api_keys=("kc",), weight=0.5),
    Tenant(name="flood", api_keys=("kf",)),
    Tenant(name="light", api_keys=("kl",)),
)

spec = st.tuples(
    st.integers(0, 3),  # class level
    st.sampled_from("abc"),  # tenant
    st.floats(0.0, 100.0),  # arrival
    st.floats(0.0, 50.0),  # time to its deadline
    st.integers(1, 5000),  # cost
)


def _req(i: int, level: int, tenant: str, arrival: float, slack: float, cost: int) -> Request:
    r = Request(f"r{i}", tenant, ("realtime", "api", "batch", "offline")[level], level, arrival,
                arrival + slack, cost, 16)
    r.cost = float(cost)
    return r


def test_order_values_keep_bands_apart() -> None:
    assert order_value(0, 0) < order_value(0, STRIDE * 10) < order_value(1, -5) < order_value(1, 1)
    assert order_value(2, float("inf")) == 3 * STRIDE - 1
    assert order_value(1, float("nan")) == STRIDE
    assert order_value(1, -1.0) < order_value(1, 0.0) < order_value(1, 1.0)  # a lift below 0
    assert [band_of(order_value(b, 12345.6)) for b in range(4)] == [0, 1, 2, 3]
    assert 16 * STRIDE < 2**53  # exact as a double: nothing in between can reorder it


@settings(max_examples=200, deadline=None)
@given(specs=st.lists(spec, min_size=1, max_size=60), policy=st.sampled_from(POLICY_NAMES))
def test_the_forwarded_order_is_monotone_in_the_pick_order(
    specs: list[tuple[int, str, float, float, int]], policy: str
) -> None:
    """Pop everything queued in qosgate's order: inside each engine band the forwarded values
    never go down, and where the policy's bands are strict (``priority``; ``qos``'s realtime
    band over the rest) or there is one band (``fifo``) the whole sequence never goes down."""
    cfg = default_config(policy=policy, tenants=TENANTS)
    pol = build_policy(cfg)
    for i, s in enumerate(sorted(specs, key=lambda s: s[2])):  # pushed in arrival order
        pol.push(_req(i, *s))
    orders: list[int] = []
    while (req := pol.pop()) is not None:
        orders.append(pol.order(req))
    assert len(orders) == len(specs)
    by_band: dict[int, list[int]] = {}
    for o in orders:
        by_band.setdefault(band_of(o), []).append(o)
    for seq in by_band.values():
        assert seq == sorted(seq)
    if policy in ("fifo", "priority"):
        assert orders == sorted(orders)
    if policy == "fifo":
        assert set(by_band) == {0}  # classes mean nothing to fifo: the engine is not told them
    if policy == "qos":
        strict = [band_of(o) == 0 for o in orders]
        assert strict == sorted(strict, reverse=True)  # realtime's band first, then the rest


@settings(max_examples=200, deadline=None)
@given(specs=st.lists(spec, min_size=1, max_size=40), started=st.lists(st.booleans()),
       newcomer=st.integers(1, 3))
def test_a_tenant_back_from_idle_goes_before_the_unstarted_work(
    specs: list[tuple[int, str, float, float, int]], started: list[bool], newcomer: int
) -> None:
    """Under ``qos`` a tenant returning from idle is lifted no further than just before the
    oldest request of its class that was dispatched and has not started: the engine runs it
    before all of them. Started ones do not hold it back."""
    cfg = default_config(policy="qos", tenants=TENANTS)
    pol = build_policy(cfg)
    level = newcomer
    for i, (_, tenant, arrival, slack, cost) in enumerate(specs):
        pol.push(_req(i, level, tenant, arrival, slack, cost))
    popped = [pol.pop() for _ in range(len(specs) // 2 + 1)]
    unstarted: list[int] = []
    for req, go in zip(popped, started + [False] * len(popped), strict=False):
        assert req is not None
        if go:
            pol.started(req)
        else:
            unstarted.append(pol.order(req))
    light = _req(999, level, "light", 200.0, 1.0, 10)
    pol.push(light)
    while (req := pol.pop()) is not light:  # (queued ones with lower counters go first)
        assert req is not None
    if unstarted:
        assert pol.order(light) < min(unstarted)


def _sched(ordered: bool = True, overtake: bool = True, window: int = 4) -> Harness:
    # no reserve: on a window this small the default keeps one slot for realtime; and its
    # engine takes 10 s to start a request, past api's TTFT budget: admitted on queue time
    cfg = default_config(policy="qos", tenants=TENANTS,
                         classes=admitted_on_queue_time(with_reserve(0.0)))
    cfg = cfg.model_copy(update={"fleet": cfg.fleet.model_copy(update={
        "window": cfg.fleet.window.model_copy(update={"overtake": overtake})})})
    sched = Scheduler(cfg, "qos", [ReplicaSpec("r0", window, window_mode="fixed", ordered=ordered)])
    # an engine slow to start anything: what it was sent stays unstarted while we look
    return Harness(sched, prefill_s=10.0, decode_s=0.1)


def test_a_light_tenant_overtakes_the_flood_the_engine_has_not_started() -> None:
    h = _sched()
    flood = [h.submit("api", "kf", prompt=50, output=20) for _ in range(6)]
    assert [r.state for r in flood] == [State.DISPATCHED] * 4 + [State.QUEUED] * 2
    light = h.submit("api", "kl", prompt=50, output=5)
    # past the full window, and ahead of every flood request the engine holds
    assert light.state is State.DISPATCHED and light.replica == "r0"
    assert h.sched.overtakes["r0"] == 1
    assert light.order is not None
    assert all(light.order < (f.order or 0) for f in flood[:4])
    # another flood request overtakes nothing: it would run after what the engine holds
    more = h.submit("api", "kf", prompt=50, output=20)
    assert more.state is State.QUEUED and h.sched.overtakes["r0"] == 1
    # a second light one: its tenant has had its turn, so it goes after the flood's oldest
    # but still before the rest of what the engine holds, past the window by one more
    light2 = h.submit("api", "kl", prompt=50, output=5)
    assert light2.state is State.DISPATCHED and h.sched.overtakes["r0"] == 2
    held = sorted(f.order or 0 for f in flood[:4])
    assert light2.order is not None
    assert light.order < held[0] < light2.order < held[1]
    h.run_until(1000.0)
    assert not h.sched.requests  # everything ended, once (the harness checks after each event)


def test_no_overtaking_where_the_engine_ignores_the_order_or_it_is_off() -> None:
    for h in (_sched(ordered=False), _sched(overtake=False)):
        for _ in range(6):
            h.submit("api", "kf", prompt=50, output=20)
        light = h.submit("api", "kl", prompt=50, output=5)
        assert light.state is State.QUEUED and not h.sched.overtakes
        h.run_until(12.5)  # the first flood requests end: a slot goes to the light tenant
        assert light.state is not State.QUEUED
        h.run_until(1000.0)
        assert not h.sched.requests


def test_started_work_does_not_hold_a_newcomer_back() -> None:
    """Once the flood's requests have started, a light tenant arriving is lifted to the flood's
    counter as plain VTC does: no credit beyond the work still waiting in the engine."""
    h = _sched(overtake=False)
    flood = [h.submit("api", "kf", prompt=50, output=200) for _ in range(5)]
    h.run_until(10.5)  # the first four have started (their first token came)
    assert [f.state for f in flood[:4]] == [State.RUNNING] * 4
    light = h.submit("api", "kl", prompt=50, output=5)
    assert light.state is State.QUEUED
    h.run_until(1000.0)
    assert light.order is not None
    assert all(light.order > (f.order or 0) for f in flood[:4])


def test_a_retry_keeps_its_place_in_the_engine_order() -> None:
    h = _sched(window=2)
    first = h.submit("api", "ka", prompt=50, output=20)
    h.submit("api", "ka", prompt=50, output=20)
    h.submit("api", "kb", prompt=50, output=20)
    placed = first.order
    assert placed is not None
    h.fail_attempt(first.id)  # before its first token: re-queued, and dispatched again
    h.run_until(100.0)
    assert first.failures == 1 and first.order is not None and first.order <= placed
