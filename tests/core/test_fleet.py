"""The core's replica seams: model-aware routing, retry before the first byte, outlier ejection,
back-pressure cooling, health, the charge of a stream cut short, and the snapshot."""

from __future__ import annotations

from qosgate.config import Fleet, Outlier, Retries, Tenant, TenantLimits, default_config
from qosgate.core import Dispatch, Finished, QosInputs, ReplicaSpec, Scheduler, State
from qosgate.core.decisions import Decision
from qosgate.core.replica import OutlierDetector
from qosgate.core.signals import LoadSignals


def _sched(*specs: ReplicaSpec, **cfg: object) -> Scheduler:
    return Scheduler(default_config(**cfg), "qos", list(specs))


def _submit(s: Scheduler, rid: str, now: float = 0.0, model: str = "", cls: str = "api",
            key: str | None = None, prompt: int = 10, max_tokens: int = 100) -> list[Decision]:
    req = s.make_request(rid, QosInputs(api_key=key, qos_class=cls), now, prompt, max_tokens,
                         model)
    return s.submit(req, now)


def _dispatched(ds: list[Decision]) -> dict[str, str]:
    return {d.req.id: d.replica for d in ds if isinstance(d, Dispatch)}


def _finished(ds: list[Decision]) -> dict[str, tuple[str, str]]:
    return {d.req.id: (d.req.state.value, d.req.reason) for d in ds if isinstance(d, Finished)}


def test_requests_go_only_to_replicas_serving_their_model() -> None:
    s = _sched(ReplicaSpec("a", 4, models=("m-a",)), ReplicaSpec("b", 4, models=("m-b",)))
    got: dict[str, str] = {}
    for i in range(6):
        got |= _dispatched(_submit(s, f"x{i}", model="m-a" if i % 2 else "m-b"))
    assert got == {f"x{i}": ("a" if i % 2 else "b") for i in range(6)}
    # m-a's replica is full (4 in flight): the next m-a request waits although b has room
    for i in range(6, 10):
        got |= _dispatched(_submit(s, f"x{i}", model="m-a"))
    assert [got.get(f"x{i}") for i in range(6, 10)] == ["a", None, None, None]
    assert s.replicas["b"].free == 1


def test_a_failed_attempt_is_retried_elsewhere_in_its_place_and_charged_once() -> None:
    cfg = {"tenants": (Tenant(name="t", api_keys=("k",),
                              limits=TenantLimits(tokens_per_minute=10_000)),)}
    s = _sched(ReplicaSpec("a", 1), ReplicaSpec("b", 2), **cfg)  # type: ignore[arg-type]
    assert _dispatched(_submit(s, "r1", key="k")) == {"r1": "b"}  # the most free
    bucket = s._limiters["t"].tpm
    assert bucket is not None
    before = bucket.tokens
    req = s.requests["r1"]
    deadline = req.deadline
    out = s.attempt_failed("r1", 0.0, "upstream_500")  # time stands still: no refill
    # re-queued with its deadline and sent to the other replica although b has more room
    assert _dispatched(out) == {"r1": "a"} and req.deadline == deadline
    assert s.retries[("api", "b", "upstream_500")] == 1
    assert bucket.tokens == before  # a retry takes nothing more from the tenant's limits
    s.first_token("r1", 0.0)
    s.complete("r1", 0.0, 50)
    # charged once, at its real use: 10 prompt + 50 output tokens of the 10,000
    assert bucket.tokens == 10_000 - 60


def test_retry_cap_and_non_retryable_failures_end_the_request() -> None:
    s = _sched(ReplicaSpec("a", 2), ReplicaSpec("b", 2),
               fleet=Fleet(retries=Retries(max_attempts=2)))
    _submit(s, "r1")
    out = s.attempt_failed("r1", 0.1, "upstream_502")
    assert s.requests["r1"].state is State.DISPATCHED  # retried at once on the other replica
    out = s.attempt_failed("r1", 0.2, "upstream_502")
    assert _finished(out) == {"r1": ("failed", "upstream_502")}
    _submit(s, "r2")
    out = s.attempt_failed("r2", 0.3, "first_byte_timeout", retryable=False)
    assert _finished(out) == {"r2": ("timed_out", "first_byte_timeout")}


def test_a_replica_is_ejected_after_consecutive_failures_and_comes_back() -> None:
    out_cfg = Fleet(outlier=Outlier(consecutive_failures=3, base_ejection_s=30, jitter=0),
                    retries=Retries(max_attempts=10, min_retries=100))
    s = _sched(ReplicaSpec("a", 1), ReplicaSpec("b", 1), fleet=out_cfg)
    s.replicas["b"].limit.set(0)  # type: ignore[attr-defined]
    s._refresh(0.0)
    _submit(s, "r1")
    for i in range(3):
        assert s.requests["r1"].replica == "a"
        s.attempt_failed("r1", 1.0 + i, "upstream_unreachable")
    assert s.replicas["a"].breaker.state(3.0) == "open"
    assert s.requests["r1"].state is State.QUEUED  # nowhere to go: waits, is not sent to a
    assert s.next_timer() is not None and abs(s.next_timer() - 33.0) < 1e-9  # type: ignore[operator]
    out = s.tick(33.0)
    assert _dispatched(out) == {"r1": "a"}
    snap = s.snapshot(33.0)
    assert [(r.name, r.breaker, r.ejections) for r in snap.replicas] == [
        ("a", "closed", 1), ("b", "closed", 0)]
    # a success resets the count: three more failures are needed to eject again
    s.first_token("r1", 34.0)
    assert s.replicas["a"].breaker.allow(34.0)


def test_ejection_time_grows_with_each_ejection_and_is_capped() -> None:
    b = OutlierDetector(consecutive=1, base_s=30, max_s=100, jitter=0)
    t = 0.0
    spans = []
    for _ in range(5):
        b.on_result(t, False)
        spans.append(b.ejected_until - t)
        t = b.ejected_until
    assert spans == [30, 60, 90, 100, 100]


def test_backpressure_cools_a_replica_without_ejecting_it() -> None:
    s = _sched(ReplicaSpec("a", 2), ReplicaSpec("b", 2),
               fleet=Fleet(outlier=Outlier(consecutive_failures=1)))
    ds = _dispatched(_submit(s, "r1"))
    first = ds["r1"]
    s.attempt_failed("r1", 1.0, "upstream_429", backpressure=True, retry_after=5.0)
    rep = s.replicas[first]
    assert rep.breaker.state(1.0) == "closed" and rep.breaker.ejections == 0
    assert not rep.eligible(2.0) and rep.eligible(6.0)
    assert s.requests["r1"].replica != first  # went to the other one
    snap = s.snapshot(2.0)
    assert {r.name: r.cooling_s for r in snap.replicas}[first] == 4.0


def test_a_refused_connection_marks_the_replica_down_until_a_probe_says_up() -> None:
    s = _sched(ReplicaSpec("a", 2, models=("m",)), ReplicaSpec("b", 2, models=("m",)))
    _submit(s, "r1", model="m")
    first = s.requests["r1"].replica
    assert first is not None
    s.attempt_failed("r1", 0.5, "upstream_unreachable", unreachable=True)
    assert not s.replicas[first].up
    other = "b" if first == "a" else "a"
    assert s.requests["r1"].replica == other  # retried at once on the other one
    s.attempt_failed("r1", 0.6, "upstream_unreachable", unreachable=True)
    assert s.requests["r1"].state is State.QUEUED  # both down: it waits in the queue
    # every replica of the model is down: refused at once, honestly, not queued
    out = _submit(s, "r2", now=0.7, model="m")
    assert _finished(out) == {"r2": ("rejected", "no_replica_available")}
    assert out[0].req.retry_after is not None  # type: ignore[union-attr]
    out = s.observe(first, 1.0, up=True, signals=LoadSignals(at=1.0, waiting=0))
    assert _dispatched(out) == {"r1": first}
    assert s.snapshot(1.0).replicas[0].signals is not None


def test_a_stream_cut_short_charges_what_was_streamed() -> None:
    limits = TenantLimits(tokens_per_minute=100_000)
    s = _sched(ReplicaSpec("a", 2),
               tenants=(Tenant(name="t", api_keys=("k",), limits=limits),))
    _submit(s, "r1", key="k", prompt=10, max_tokens=1000)
    bucket = s._limiters["t"].tpm
    assert bucket is not None
    s.first_token("r1", 0.1)
    s.progress("r1", 990)
    s.cancel("r1", 0.2)
    # 10 prompt + 990 streamed were used: not refunded
    assert bucket.tokens <= 100_000 - 1000 + 1e-6


def test_the_retry_budget_bounds_concurrent_retries() -> None:
    s = _sched(ReplicaSpec("a", 10), ReplicaSpec("b", 0),
               fleet=Fleet(retries=Retries(budget_percent=0, min_retries=2),
                           outlier=Outlier(enabled=False)))
    for i in range(5):
        _submit(s, f"r{i}")
    ends = {}
    for i in range(5):
        ends |= _finished(s.attempt_failed(f"r{i}", 1.0, "upstream_500"))
    # two retries in flight at most; the third failure and later end the request
    assert sorted(ends) == ["r2", "r3", "r4"]
