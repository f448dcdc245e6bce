"""How compose.py wires the scheduler: admission reads the other instances' load through the
shared state's ``peers``, the instance publishes its own scheduler's load, and the models'
engine profiles set their weights."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from qosgate.config import config_from_mapping, default_config
from qosgate.core import QosInputs, ReplicaSpec, Scheduler
from qosgate.core.ledger import LeasedLedger
from qosgate.core.peers import load_in
from qosgate.core.shared import Heartbeat
from qosgate.models.simmodel import load_profile
from qosgate.models.token_times import token_times
from qosgate.server.compose import _shared_state
from qosgate.settings import RedisSettings
from tests.support.inprocess import InProcessGateway


def test_admission_reads_the_peers_and_the_heartbeat_carries_this_schedulers_load() -> None:
    sched = Scheduler(default_config(), "qos", [ReplicaSpec("r0", 1, window_mode="fixed")])
    for i in range(3):
        sched.submit(sched.make_request(f"a{i}", QosInputs(qos_class="api"), 0.0, 10, 10), 0.0)
    # (a Redis client connects on its first call: none is made here)
    shared = _shared_state(RedisSettings(url="redis://127.0.0.1:1/0"), LeasedLedger(), sched,
                           "i0", lambda: 0.0)
    assert shared is not None
    protocol = shared.protocol
    assert sched.admission.peers is protocol.peers
    heartbeat = next(protocol.sync())
    assert isinstance(heartbeat, Heartbeat)
    info = json.loads(heartbeat.info)
    assert info["queued_total"] == 2 and info["inflight"] == 1  # what it carried before
    assert load_in(heartbeat.info) == ([len(b) for b in sched.backlog.by_class], 0.0)
    assert sum(info["queued_by_class"]) == 2


def test_the_gateway_weighs_models_by_their_engine_profiles() -> None:
    config = """
models:
  - {name: small, profile: llama-3-8b-h100}
  - {name: slow, profile: llama-3-8b-a100}
"""
    with InProcessGateway(config) as gw:
        weights = gw.gateway.scheduler.pricing.weights
        ref, other = token_times(load_profile("llama-3-8b-h100")), token_times(
            load_profile("llama-3-8b-a100"))
        w = weights.of("slow")
        assert w.source == "profile"
        assert w.output == pytest.approx(other.decode_s / ref.decode_s)
        assert weights.of("small").output == 1.0


def test_a_reload_keeps_the_weights_the_profiles_gave() -> None:
    config = """
models:
  - {name: small, profile: llama-3-8b-h100}
  - {name: slow, profile: llama-3-8b-a100}
tenants:
  - {name: acme, api_keys: [sk-acme]}
"""
    with InProcessGateway(config) as gw:
        app = gw.gateway
        before = app.scheduler.pricing.weights.of("slow")
        doc = yaml.safe_load(config)
        doc["tenants"].append({"name": "newco", "api_keys": ["sk-new"]})
        app.config_source = lambda: (config_from_mapping(doc), app.settings)
        found = gw._run(_reloaded(app))
        assert found.tenants_added == ("newco",)
        after = app.scheduler.pricing.weights.of("slow")
        assert after == before and after.source == "profile"


async def _reloaded(app: Any) -> Any:
    """The reload, on the gateway's loop (as the admin endpoint runs it)."""
    return app.reload()
