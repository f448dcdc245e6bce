"""The other instances' load, as their heartbeats said: what one instance publishes, what it
sums of the others', and how it forgets them when its own syncs stop."""

from __future__ import annotations

import json
import math

from qosgate.config import default_config
from qosgate.core import QosInputs, ReplicaSpec, Scheduler
from qosgate.core.ledger import LeasedLedger
from qosgate.core.peers import PeerLoad, load_in, load_of, with_load
from qosgate.core.shared import MemoryStore, StoreDown, SyncProtocol, run_to_end


def _info(queued: list[int], rate: float, **extra: object) -> str:
    return json.dumps({**extra, "queued_by_class": queued, "completion_rate": rate})


def test_the_load_is_merged_into_what_the_info_carried() -> None:
    info = with_load('{"queued_total":3,"inflight":2}', ([1, 0, 2, 0], 4.5))
    assert json.loads(info) == {"queued_total": 3, "inflight": 2,
                                "queued_by_class": [1, 0, 2, 0], "completion_rate": 4.5}
    assert load_in(info) == ([1, 0, 2, 0], 4.5)
    assert load_in(with_load("", ([0], 0.0))) == ([0], 0.0)


def test_an_info_without_a_load_carries_none() -> None:
    for info in ("{}", "not json", "[1, 2]", '{"queued_by_class": [1], "completion_rate": "x"}',
                 '{"queued_by_class": ["a"], "completion_rate": 1.0}',
                 '{"queued_by_class": [1], "completion_rate": NaN}'):
        assert load_in(info) is None, info


def test_the_others_are_summed_and_this_instance_left_out() -> None:
    peers = PeerLoad(ttl=2.0)
    peers.hear({
        "me": _info([100, 100, 100, 100], 100.0),
        "a": _info([1, 2, 3, 4], 1.5),
        "b": _info([10, 20], 2.5, queued_total=30),
        "old": "{}",  # an instance that publishes no load adds none
    }, "me", now=5.0)
    assert [peers.queued(level) for level in range(4)] == [11, 22, 3, 4]
    assert peers.queued(4) == peers.queued(-1) == 0
    assert peers.rate() == 4.0
    assert peers.instances == 2
    # the next answer replaces the last: an instance that dropped out of it is gone
    peers.hear({"me": _info([0], 0.0), "a": _info([1, 2, 3, 4], 1.5)}, "me", now=6.0)
    assert [peers.queued(level) for level in range(4)] == [1, 2, 3, 4]
    assert peers.rate() == 1.5 and peers.instances == 1


def test_what_was_heard_ages_and_is_forgotten_after_the_ttl() -> None:
    peers = PeerLoad(ttl=2.0)
    assert peers.age(0.0) == math.inf
    peers.expire(100.0)  # nothing heard: nothing to forget
    peers.hear({"a": _info([3], 1.0)}, "me", now=10.0)
    assert peers.age(11.5) == 1.5
    peers.expire(11.9)
    assert peers.queued(0) == 3 and peers.rate() == 1.0
    peers.expire(12.0)
    assert peers.queued(0) == 0 and peers.rate() == 0.0 and peers.instances == 0


def test_an_instance_publishes_its_queue_per_class_and_completion_rate() -> None:
    sched = Scheduler(default_config(), "qos", [ReplicaSpec("r0", 1, window_mode="fixed")])
    for i in range(3):
        req = sched.make_request(f"a{i}", QosInputs(qos_class="api"), 0.0, 10, 10)
        sched.submit(req, 0.0)
    api = next(c.level for c in sched.classes if c.name == "api")
    queued, rate = load_of(sched, 0.0)
    assert len(queued) == len(sched.classes)
    assert queued[api] == 2 and sum(queued) == 2  # one runs, two wait
    assert rate == sched.admission.completions.value(0.0) == 0.0
    for k in range(6):
        sched.admission.completions.add(float(k))
    assert load_of(sched, 6.0)[1] == sched.admission.completions.value(6.0) > 0.0


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _instance(name: str, clock: _Clock, queued: list[int], rate: float) -> SyncProtocol:
    return SyncProtocol(LeasedLedger(), name, None, 0.05, lease_ttl=2.0,
                        info=lambda: '{"queued_total":0}', load=lambda: (queued, rate),
                        clock=clock)


def test_two_instances_see_each_others_load_through_the_store() -> None:
    store = MemoryStore()
    clock = _Clock()
    a = _instance("a", clock, [0, 4, 0, 0], 3.0)
    b = _instance("b", clock, [1, 0, 5, 0], 2.0)
    run_to_end(a.sync(), store, clock.now)  # a first: b has not heart-beaten yet
    assert a.peers.instances == 0 and a.peers.rate() == 0.0
    clock.now = 0.05
    run_to_end(b.sync(), store, clock.now)
    assert [b.peers.queued(level) for level in range(4)] == [0, 4, 0, 0]
    assert b.peers.rate() == 3.0 and b.peers.heard_at == 0.05
    clock.now = 0.1
    run_to_end(a.sync(), store, clock.now)
    assert [a.peers.queued(level) for level in range(4)] == [1, 0, 5, 0]
    assert a.peers.rate() == 2.0
    # what the info carried before is kept beside the load
    assert json.loads(a.fleet["b"])["queued_total"] == 0
    # b stops heart-beating: it drops out with the heartbeat's TTL
    clock.now = 2.1
    run_to_end(a.sync(), store, clock.now)
    assert a.peers.instances == 0 and a.peers.queued(2) == 0 and a.peers.rate() == 0.0


def test_an_instance_whose_syncs_fail_forgets_the_others_after_the_ttl() -> None:
    store = MemoryStore()
    clock = _Clock()
    a = _instance("a", clock, [0, 1, 0, 0], 1.0)
    b = _instance("b", clock, [0, 2, 0, 0], 1.0)
    run_to_end(b.sync(), store, 0.0)
    run_to_end(a.sync(), store, 0.0)
    assert a.peers.queued(1) == 2
    store.down = True
    for now in (0.5, 1.0, 1.5):
        try:
            run_to_end(a.sync(), store, now)
        except StoreDown as exc:
            a.sync_failed(now, str(exc))
    assert a.peers.queued(1) == 2  # not yet the TTL: the others may still be there
    a.sync_failed(2.0, "store down")
    assert a.peers.queued(1) == 0 and a.peers.rate() == 0.0
