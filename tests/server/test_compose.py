"""How compose.py wires the shared state to the scheduler: admission reads the other instances'
load through the protocol's ``peers``, and the instance publishes its own scheduler's load."""

from __future__ import annotations

import json

from qosgate.config import default_config
from qosgate.core import QosInputs, ReplicaSpec, Scheduler
from qosgate.core.ledger import LeasedLedger
from qosgate.core.peers import load_in
from qosgate.core.shared import Heartbeat
from qosgate.server.compose import _shared_state
from qosgate.settings import RedisSettings


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
