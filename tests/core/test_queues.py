"""The queue nodes: a request popped and put back (held) is as if never popped."""

from __future__ import annotations

from qosgate.config import default_config
from qosgate.core import QosInputs, Request
from qosgate.core.policies import build_policy
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
        for i in range(2):
            policy.push(_req(s, f"a{i}", "api", 0.0))
        first = policy.pop()  # offline (first in on a tie): api is behind from here on
        assert first is not None and first.service_class == "offline"
        if hold:
            held = [policy.pop(), policy.pop()]
            assert [r.id for r in held if r is not None] == ["a0", "a1"]
            for r in held:
                assert r is not None
                policy.restore(r)
        order = []
        while (r := policy.pop()) is not None:
            order.append(r.id)
        orders.append(order)
    assert orders[1] == orders[0]
    assert orders[0][:2] == ["a0", "a1"]
