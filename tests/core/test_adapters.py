"""LoRA adapters in the core: which ones a replica holds, the routing that prefers a replica
holding the adapter while the load allows, and the load cost charged to the request that makes a
replica load it."""

from __future__ import annotations

import pytest

from qosgate.config import Fleet, ModelSpec, Tenant, default_config
from qosgate.core import Dispatch, QosInputs, ReplicaSpec, Request, Scheduler
from qosgate.core.adapters import LoadedAdapters
from qosgate.core.decisions import Decision
from qosgate.core.signals import LoadSignals

BASE = "smollm2"
LOAD = 4096.0  # reference tokens for a cold load: two window slots' worth of prompt


# ---------------------------------------------------------------- what a replica holds
def test_sent_adapters_are_held_least_recent_evicted_first() -> None:
    held = LoadedAdapters()
    held.observe((), 2, at=0.0)
    held.sent("a", 1.0)
    held.sent("b", 2.0)
    held.sent("a", 3.0)
    held.sent("c", 4.0)  # b was used least recently: gone
    assert held.names() == ("c", "a")
    assert not held.holds("b")


def test_the_scrape_replaces_what_it_saw_and_keeps_what_was_sent_since() -> None:
    held = LoadedAdapters()
    held.observe(("x", "y"), 3, at=10.0)
    assert held.names() == ("x", "y")
    held.sent("z", 11.0)  # after that scrape: the next one may not show it yet
    held.observe(("y",), 3, at=12.0)
    assert held.names() == ("z", "y")
    held.observe(("y",), 3, at=14.0)  # two scrapes later, and the engine does not name it
    assert held.names() == ("y",)


def test_capacity_defaults_to_one_until_a_scrape_says() -> None:
    held = LoadedAdapters()
    held.sent("a", 0.0)
    held.sent("b", 0.0)
    assert held.names() == ("b",)
    held.forget()
    assert held.names() == ()


# ---------------------------------------------------------------- routing and the charge
def _sched(router: str = "least-load", load: float = LOAD, models: tuple[str, ...] = (BASE,),
           window: int = 8) -> Scheduler:
    cfg = default_config(
        tenants=(Tenant(name="t", api_keys=("k",)),),
        models=(ModelSpec(name=BASE), ModelSpec(name="ad-x", base=BASE, load_cost=load),
                ModelSpec(name="ad-y", base=BASE, load_cost=load)),
        fleet=Fleet(router=router))  # type: ignore[arg-type]
    return Scheduler(cfg, "qos", [ReplicaSpec(f"r{i}", window, window_mode="fixed", models=models)
                                  for i in range(2)])


def _holding(s: Scheduler, replica: str, *adapters: str, waiting: int = 0,
             now: float = 0.0) -> None:
    s.observe(replica, now, signals=LoadSignals(at=now, running=0, waiting=waiting,
                                                adapters=adapters, adapter_capacity=2))


def _submit(s: Scheduler, rid: str, model: str, now: float = 0.0) -> list[Decision]:
    req = s.make_request(rid, QosInputs(api_key="k", qos_class="api"), now, 100, 50, model)
    return s.submit(req, now)


def _where(ds: list[Decision]) -> dict[str, str]:
    return {d.req.id: d.replica for d in ds if isinstance(d, Dispatch)}


@pytest.mark.parametrize("router", ["least-load", "session-affinity", "cache-aware"])
def test_an_adapter_goes_where_it_is_loaded(router: str) -> None:
    s = _sched(router)
    _holding(s, "r0")
    _holding(s, "r1", "ad-x")
    assert _where(_submit(s, "1", "ad-x")) == {"1": "r1"}
    assert s.requests["1"].loads == 0


def test_an_adapter_of_a_base_is_served_by_the_base_replicas() -> None:
    s = _sched()
    assert s.fleet.replicas["r0"].serves("ad-x")
    assert _where(_submit(s, "1", "ad-y")), "admitted and dispatched, not an unknown model"


def test_a_replica_sent_the_adapter_is_warm_before_its_scrape_says() -> None:
    s = _sched()
    _holding(s, "r0")
    _holding(s, "r1")
    first = _where(_submit(s, "1", "ad-x"))["1"]
    # the second goes where the first went, though that replica is busier now
    assert _where(_submit(s, "2", "ad-x")) == {"2": first}
    assert [s.requests[r].loads for r in ("1", "2")] == [1, 0]


@pytest.mark.parametrize(("load", "where", "loads"), [(256.0, "r0", 1), (16384.0, "r1", 0)])
def test_a_warm_replica_is_passed_over_when_busier_by_more_than_the_load(
        load: float, where: str, loads: int) -> None:
    s = _sched(load=load)
    _holding(s, "r0")
    _holding(s, "r1", "ad-x", waiting=1)  # an eighth of its window queued in the engine
    assert _where(_submit(s, "x", "ad-x")) == {"x": where}
    assert s.requests["x"].loads == loads


def test_the_request_that_makes_a_replica_load_pays_the_load() -> None:
    s = _sched()
    _holding(s, "r0")
    _holding(s, "r1")
    deltas: list[float] = []
    settle = s.policy.settle

    def recorded(req: Request, delta: float) -> None:
        deltas.append(delta)
        settle(req, delta)

    s.policy.settle = recorded
    cold = s.make_request("c", QosInputs(api_key="k", qos_class="api"), 0.0, 100, 50, "ad-x")
    estimate = cold.cost
    s.submit(cold, 0.0)
    assert cold.loads == 1 and cold.cost == pytest.approx(estimate + LOAD)
    warm = s.make_request("w", QosInputs(api_key="k", qos_class="api"), 0.0, 100, 50, "ad-x")
    s.submit(warm, 0.0)
    assert warm.loads == 0 and warm.cost == pytest.approx(estimate)
    # settled at the end: its tenant paid the tokens it used and the load
    deltas.clear()
    s.first_token("c", 0.5)
    s.complete("c", 1.0, output_tokens=30)
    charged = estimate + LOAD + sum(deltas)
    assert charged == pytest.approx(s.pricing.used(100, 30, True, "ad-x") + LOAD)


def test_a_model_without_a_load_cost_has_no_affinity_and_no_charge() -> None:
    s = _sched(load=0.0)
    _holding(s, "r0")
    _holding(s, "r1", "ad-x")
    _submit(s, "1", "ad-x")
    assert s.requests["1"].loads == 0
    assert s.requests["1"].load_cost == 0.0


def test_a_restarted_engine_holds_no_adapter() -> None:
    s = _sched()
    s.observe("r1", 0.0, signals=LoadSignals(at=0.0, preemptions_total=5, adapters=("ad-x",),
                                             adapter_capacity=2))
    assert s.fleet.replicas["r1"].adapters.holds("ad-x")
    s.observe("r1", 1.0, signals=LoadSignals(at=1.0, preemptions_total=0))
    assert not s.fleet.replicas["r1"].adapters.holds("ad-x")


def test_a_new_adapter_goes_where_it_evicts_none() -> None:
    s = _sched()
    s.observe("r0", 0.0, signals=LoadSignals(at=0.0, adapters=("ad-x",), adapter_capacity=1))
    s.observe("r1", 0.0, signals=LoadSignals(at=0.0, adapters=(), adapter_capacity=1))
    # ad-y is cold on both; on r0 it would evict ad-x, on r1 it takes the free slot
    assert _where(_submit(s, "y", "ad-y")) == {"y": "r1"}
    assert _where(_submit(s, "x", "ad-x")) == {"x": "r0"}
    assert [s.requests[r].loads for r in ("y", "x")] == [1, 0]
