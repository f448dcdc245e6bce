"""Admission's TTFT forecast where a heavy and a light model have their own replicas: a heavy
model's slow first tokens must not make the light model's realtime forecast pessimistic (it
would be refused while its own replica answers in time), nor the light model's quick ones make
the heavy model's look fast."""

from __future__ import annotations

from qosgate.config import ModelSpec, default_config
from qosgate.core import Dispatch, QosInputs, ReplicaSpec, Scheduler
from qosgate.core.decisions import Decision, Finished

LIGHT, HEAVY = "light", "heavy"
LIGHT_FIRST_S, HEAVY_FIRST_S = 0.1, 3.0  # dispatch to first token on each model's replica


def _fleet() -> Scheduler:
    specs = [ReplicaSpec("light", 4, models=(LIGHT,), window_mode="fixed"),
             ReplicaSpec("heavy", 4, models=(HEAVY,), window_mode="fixed")]
    models = (ModelSpec(name=LIGHT), ModelSpec(name=HEAVY, weight=10.0))
    return Scheduler(default_config(models=models), "qos", specs)


def _serve(s: Scheduler, ds: list[Decision], now: float, pending: dict[str, float]) -> None:
    """Each dispatched request's first token comes its model's time after dispatch."""
    for d in ds:
        if isinstance(d, Dispatch):
            took = HEAVY_FIRST_S if d.req.model == HEAVY else LIGHT_FIRST_S
            pending[d.req.id] = now + took


def _run_until(s: Scheduler, end: float, pending: dict[str, float],
               running: dict[str, float], now: float) -> float:
    """First tokens and completions (a second after the first token) until ``end``."""
    while now < end:
        now = round(now + 0.05, 2)
        for rid, at in sorted(pending.items()):
            if at <= now:
                del pending[rid]
                s.first_token(rid, now)
                running[rid] = now + 1.0
        for rid, at in sorted(running.items()):
            if at <= now:
                del running[rid]
                _serve(s, s.complete(rid, now, 20), now, pending)
        _serve(s, s.tick(now), now, pending)
    return now


def test_a_heavy_batch_flood_leaves_the_light_models_realtime_forecast_its_own() -> None:
    s = _fleet()
    pending: dict[str, float] = {}
    running: dict[str, float] = {}
    now = 0.0
    # the light model's realtime, served alone a while (its first tokens are quick)
    for i in range(20):
        req = s.make_request(f"rt{i}", QosInputs(qos_class="realtime"), now, 200, 20, LIGHT)
        _serve(s, s.submit(req, now), now, pending)
        now = _run_until(s, now + 0.5, pending, running, now)
    # a flood of heavy batch: its replica is full, its queue long, its first tokens slow
    for i in range(40):
        req = s.make_request(f"b{i}", QosInputs(qos_class="batch"), now, 200, 20, HEAVY)
        _serve(s, s.submit(req, now), now, pending)
    now = _run_until(s, now + 30.0, pending, running, now)
    assert s.queued_total > 0  # the flood still waits
    req = s.make_request("rt-late", QosInputs(qos_class="realtime"), now, 200, 20, LIGHT)
    out = s.submit(req, now)
    assert [d.req.reason for d in out if isinstance(d, Finished)] == []  # admitted
    assert req.forecast is not None and req.forecast < 2 * LIGHT_FIRST_S
    # and the heavy model's realtime is forecast from its own slow first tokens: past
    # realtime's budget of a second, it is refused now rather than served late
    heavy = s.make_request("h-rt", QosInputs(qos_class="realtime"), now, 200, 20, HEAVY)
    out = s.submit(heavy, now)
    assert [d.req.reason for d in out if isinstance(d, Finished)] == ["deadline_infeasible"]
