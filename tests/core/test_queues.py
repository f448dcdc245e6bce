"""The queue nodes: a request popped and put back (held) is as if never popped."""

from __future__ import annotations

from qosgate.config import default_config
from qosgate.core import QosInputs, Request
from qosgate.core.queueing import build_policy
from qosgate.core.scheduler import Scheduler


def _req(s: Scheduler, rid: str, cls: str, now: float, prompt: int = 100) -> Request:
    return s.make_request(rid, QosInputs(qos_class=cls), now, prompt, 50)


def test_a_held_request_goes_back_in_place_with_its_class_keeping_its_credit() -> None:
    """api is behind its share (its counter low) when all of its queue is popped and held in
    one fill (nothing could take it), which empties api's child for a moment. Put back, the
    queue must hand out requests exactly as if nothing had been popped: re-activated with a
    VTC lift, api would lose its credit to offline on every such fill, and in the end its
    share."""
    cfg = default_config()
    s = Scheduler(cfg, "qos")
    orders = []
    for hold in (False, True):
        policy = build_policy(cfg, "qos")
        for i in range(4):
            policy.push(_req(s, f"o{i}", "offline", 0.0, prompt=1000))
        for i in range(10):
            policy.push(_req(s, f"a{i}", "api", 0.0))
        served = [policy.pop(), policy.pop()]  # api (the tie goes to the urgent class), offline
        assert [r.id for r in served if r is not None] == ["a0", "o0"]  # api is behind now
        if hold:  # the rest of api's queue, popped and held in one fill
            held = [policy.pop() for _ in range(9)]
            assert [r.id for r in held if r is not None] == [f"a{i}" for i in range(1, 10)]
            for r in held:
                assert r is not None
                policy.restore(r)
        for i in range(10, 20):  # more api: how much credit it kept shows in its turns
            policy.push(_req(s, f"a{i}", "api", 0.0))
        order = []
        while (r := policy.pop()) is not None:
            order.append(r.id)
        orders.append(order)
    assert orders[1] == orders[0]
    assert orders[0][:13] == [f"a{i}" for i in range(1, 14)]  # api's credit: its turns first
