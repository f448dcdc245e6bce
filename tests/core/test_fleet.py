"""The core's replica seams: model-aware routing, retry before the first byte, outlier ejection,
back-pressure cooling, health, the charge of a stream cut short, and the snapshot."""

from __future__ import annotations

from qosgate.config import (
    Fleet,
    Outlier,
    Retries,
    Tenant,
    TenantLimits,
    Window,
    default_config,
)
from qosgate.core import AttemptFailed, Dispatch, Finished, QosInputs, ReplicaSpec, Scheduler, State
from qosgate.core.breakers import OutlierDetector
from qosgate.core.decisions import Decision
from qosgate.core.request import LENT_PREEMPTIBLE
from qosgate.core.signals import LoadSignals
from tests.support.classes import with_reserve


def _sched_small(*specs: ReplicaSpec, **cfg: object) -> Scheduler:
    """``_sched`` for a test of another rule on windows so small that the default reserve
    (one slot kept for realtime) would change what it tests: no reserve."""
    return _sched(*specs, classes=with_reserve(0.0), **cfg)


def _sched(*specs: ReplicaSpec, **cfg: object) -> Scheduler:
    """Fixed windows (the adaptive one has a test of its own)."""
    for spec in specs:
        spec.window_mode = spec.window_mode or "fixed"
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
    s = _sched_small(ReplicaSpec("a", 4, models=("m-a",)), ReplicaSpec("b", 4, models=("m-b",)))
    got: dict[str, str] = {}
    for i in range(6):
        got |= _dispatched(_submit(s, f"x{i}", model="m-a" if i % 2 else "m-b"))
    assert got == {f"x{i}": ("a" if i % 2 else "b") for i in range(6)}
    # m-a's replica is full: the next m-a requests wait although b has room
    for i in range(6, 10):
        got |= _dispatched(_submit(s, f"x{i}", model="m-a"))
    assert [got.get(f"x{i}") for i in range(6, 10)] == ["a", None, None, None]
    assert s.replicas["a"].free == 0 and s.replicas["b"].free == 1


def test_a_failed_attempt_is_retried_elsewhere_in_its_place_and_charged_once() -> None:
    cfg = {"tenants": (Tenant(name="t", api_keys=("k",),
                              limits=TenantLimits(tokens_per_minute=10_000)),)}
    s = _sched(ReplicaSpec("a", 1), ReplicaSpec("b", 2), fleet=Fleet(router="most-free"),
               **cfg)  # type: ignore[arg-type]
    assert _dispatched(_submit(s, "r1", key="k")) == {"r1": "b"}  # the most free
    bucket = s._limiters["t"].tpm
    assert bucket is not None
    before = bucket.tokens
    req = s.requests["r1"]
    deadline = req.deadline
    out = s.attempt_failed("r1", 0.0, AttemptFailed("upstream_500"))  # time stands still: no refill
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
    out = s.attempt_failed("r1", 0.1, AttemptFailed("upstream_502"))
    assert s.requests["r1"].state is State.DISPATCHED  # retried at once on the other replica
    out = s.attempt_failed("r1", 0.2, AttemptFailed("upstream_502"))
    assert _finished(out) == {"r1": ("failed", "upstream_502")}
    _submit(s, "r2")
    out = s.attempt_failed("r2", 0.3, AttemptFailed("first_byte_timeout", retryable=False))
    assert _finished(out) == {"r2": ("timed_out", "first_byte_timeout")}


def test_a_replica_is_ejected_after_consecutive_failures_and_comes_back_on_probation() -> None:
    out_cfg = Fleet(outlier=Outlier(consecutive_failures=3, base_ejection_s=30, jitter=0),
                    retries=Retries(max_attempts=10, min_retries=100))
    s = _sched_small(ReplicaSpec("a", 4, models=("m",)), ReplicaSpec("b", 4, models=("x",)),
               fleet=out_cfg)
    _submit(s, "r1", model="m")
    for i in range(3):
        assert s.requests["r1"].replica == "a"  # the model's only replica
        s.attempt_failed("r1", 1.0 + i, AttemptFailed("upstream_500"))
    assert s.replicas["a"].breaker.state(3.0) == "open"
    assert s.requests["r1"].state is State.QUEUED  # nowhere to go: waits, is not sent to a
    assert s.next_timer() is not None and abs(s.next_timer() - 33.0) < 1e-9  # type: ignore[operator]
    _submit(s, "r2", now=10.0, model="m")
    out = s.tick(33.0)
    # back on probation (half-open): one request at a time until one succeeds
    assert _dispatched(out) == {"r1": "a"}
    snap = s.snapshot(33.0)
    assert [(r.name, r.breaker, r.ejections, r.window) for r in snap.replicas] == [
        ("a", "closed", 1, 1), ("b", "closed", 0, 4)]
    out = s.first_token("r1", 34.0)
    assert s.requests["r2"].replica == "a"  # proven: its whole window again
    assert s.replicas["a"].window == 4 and s.replicas["a"].breaker.allow(34.0)


def test_one_failure_on_probation_ejects_again() -> None:
    s = _sched_small(ReplicaSpec("a", 4, models=("m",)),
               fleet=Fleet(outlier=Outlier(consecutive_failures=2, base_ejection_s=10, jitter=0),
                           retries=Retries(max_attempts=10, min_retries=100)))
    _submit(s, "r1", model="m")
    s.attempt_failed("r1", 1.0, AttemptFailed("upstream_500"))
    s.attempt_failed("r1", 1.0, AttemptFailed("upstream_500"))
    assert s.replicas["a"].breaker.state(1.0) == "open"
    s.tick(11.0)
    assert s.requests["r1"].replica == "a"
    # one failure: out again, for longer
    s.attempt_failed("r1", 11.5, AttemptFailed("upstream_500"))
    assert s.replicas["a"].breaker.state(11.5) == "open"
    assert s.replicas["a"].breaker.ejections == 2


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
    s.attempt_failed("r1", 1.0, AttemptFailed("upstream_429", backpressure=True, retry_after=5.0))
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
    s.attempt_failed("r1", 0.5, AttemptFailed("upstream_unreachable", unreachable=True))
    assert not s.replicas[first].up
    other = "b" if first == "a" else "a"
    assert s.requests["r1"].replica == other  # retried at once on the other one
    s.attempt_failed("r1", 0.6, AttemptFailed("upstream_unreachable", unreachable=True))
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
        ends |= _finished(s.attempt_failed(f"r{i}", 1.0, AttemptFailed("upstream_500")))
    # two retries in flight at most; the third failure and later end the request
    assert sorted(ends) == ["r2", "r3", "r4"]


def test_a_reserved_share_is_kept_for_realtime_and_lent_only_to_preemptible_classes() -> None:
    s = _sched(ReplicaSpec("a", 10))  # realtime keeps 10% of each window by default
    for i in range(9):
        _submit(s, f"api{i}")
    assert len(s.replicas["a"].inflight) == 9  # api may not take the reserved slot
    out = _submit(s, "b0", cls="batch")
    assert _dispatched(out) == {"b0": "a"}  # batch may borrow it: it can give it back
    out = _submit(s, "rt", cls="realtime")
    # realtime takes it back: the borrower is pulled back (preempted) and re-queued
    assert _dispatched(out) == {"rt": "a"}
    assert s.requests["b0"].state is State.QUEUED and s.preemptions["batch"] == 1


def test_the_reserve_is_not_lent_while_a_class_that_may_not_borrow_it_waits() -> None:
    """Lent then, each slot a streaming borrower frees would again be one only a borrower may
    take, and api would starve behind offline (the inversion the reserve once caused)."""
    s = _sched(ReplicaSpec("a", 10))
    for i in range(10):
        _submit(s, f"api{i}")
    assert len(s.replicas["a"].inflight) == 9 and len(s.queued[1]) == 1
    assert _dispatched(_submit(s, "off0", cls="offline")) == {}  # api waits: not lent
    # api's turn comes from the room beyond the reserve, as slots free; with api's queue
    # empty, offline may borrow the reserve (realtime can still pull it back)
    assert _dispatched(s.complete("api0", 1.0, 5)) == {"api9": "a", "off0": "a"}


def test_a_borrower_held_while_api_waited_borrows_once_api_has_gone_in_the_same_fill() -> None:
    """The reserve is lent only while no class that may not borrow it waits: a borrower held
    for that in a fill may borrow once the last such request has gone, in the same fill (else
    it waited beside a slot it may take until some later event)."""
    s = _sched(ReplicaSpec("a", 10, models=("m2",)), ReplicaSpec("b", 1, models=("m1",)),
               ReplicaSpec("c", 1, models=("m3",)))
    for i in range(9):  # a's reserved tenth slot is realtime's (api may not borrow it)
        _submit(s, f"api{i}", model="m2")
    _submit(s, "api-b", model="m1")
    _submit(s, "api-wait", model="m1")
    assert _dispatched(_submit(s, "b0", model="m2", cls="batch")) == {}  # api waits: not lent
    # api is served on c meanwhile: batch, behind in the shares, is popped first next time
    assert _dispatched(_submit(s, "api-c", model="m3")) == {"api-c": "c"}
    # that fill holds batch while api waits, then sends api to b: nothing of api waits now,
    # so batch may borrow a's reserved slot
    assert _dispatched(s.complete("api-b", 1.0, 5)) == {"api-wait": "b", "b0": "a"}


def test_a_slot_lent_to_a_borrower_returns_to_the_reserve_when_its_stream_ends() -> None:
    s = _sched(ReplicaSpec("a", 10))
    for i in range(10):  # nothing else waits: the reserve is lent to the tenth
        _submit(s, f"off{i}", cls="offline")
    rep = s.replicas["a"]
    assert (rep.loans, s.requests["off9"].lent) == (1, LENT_PREEMPTIBLE)
    for i in range(10):
        s.first_token(f"off{i}", 0.5)  # streaming: an upstream cannot take them back
    assert rep.loan_streams == 1 and rep.preemptible == 0
    _submit(s, "api0", now=0.6)
    assert _dispatched(_submit(s, "rt", now=0.7, cls="realtime")) == {}  # nothing to pull back
    # the first slot to free goes to realtime, the next beyond the reserve to api: the loan
    # is offline's debt, not api's
    assert _dispatched(s.complete("off0", 1.0, 5)) == {"rt": "a"}
    assert _dispatched(s.complete("off1", 1.1, 5)) == {"api0": "a"}
    _submit(s, "off10", now=1.15, cls="offline")
    assert _dispatched(s.complete("off2", 1.2, 5)) == {"off10": "a"}  # beyond the reserve
    s.first_token("off10", 1.3)
    _submit(s, "off11", now=1.3, cls="offline")
    assert _dispatched(s.complete("api0", 1.4, 5)) == {"off11": "a"}  # beyond, again
    s.first_token("off11", 1.5)
    assert rep.free == 0 and rep.loans == 1  # the reserve's one slot: on loan to off9
    _submit(s, "off12", now=1.5, cls="offline")
    assert s.requests["off12"].state is State.QUEUED
    # the loan ends: its slot is the reserve's again, and (nothing else waiting) lent anew
    assert _dispatched(s.complete("off9", 2.0, 5)) == {"off12": "a"}
    assert s.requests["off12"].lent == LENT_PREEMPTIBLE and rep.loans == 1


def test_a_long_prefill_waits_while_a_replica_streams_to_realtime() -> None:
    s = _sched(ReplicaSpec("a", 8), ReplicaSpec("b", 8), fleet=Fleet(prefill_budget_tokens=1000))
    assert _dispatched(_submit(s, "rt", cls="realtime")) == {"rt": "a"}
    s.first_token("rt", 0.1)
    assert s.replicas["a"].strict_streams == 1
    assert _dispatched(_submit(s, "long1", now=0.2, prompt=4000)) == {"long1": "b"}
    s.first_token("long1", 0.3)
    s.observe("b", 0.3, up=False)  # now only a can take work
    # alone, a long prompt may go next to the realtime stream: one at a time
    assert _dispatched(_submit(s, "long2", now=0.4, prompt=4000)) == {"long2": "a"}
    assert _dispatched(_submit(s, "long3", now=0.5, prompt=4000)) == {}
    assert _dispatched(_submit(s, "short", now=0.5, prompt=500)) == {}
    # realtime's own prompts are not held (its TTFT would pay more than its TPOT gains)
    assert _dispatched(_submit(s, "rt-long", now=0.5, cls="realtime", prompt=3000)) == {
        "rt-long": "a"}
    assert s.replicas["a"].prefill_tokens == 7000
    assert s.replicas["a"].other_prefill_tokens == 4000
    out = s.first_token("long2", 0.6)  # answered: the next one may go, however much realtime
    assert _dispatched(out) == {"long3": "a"}  # prefill is pending (no starvation)
    assert s.requests["short"].state is State.QUEUED
    s.first_token("rt-long", 0.7)
    s.complete("rt-long", 0.8, 5)
    s.complete("rt", 1.0, 20)  # the realtime streams end: no budget any more
    assert s.requests["short"].replica == "a"
    # a held request waits only for the other classes' pending prompt, never for long
    _submit(s, "rt2", now=2.0, cls="realtime")
    s.first_token("rt2", 2.1)
    _submit(s, "long4", now=3.0, prompt=4000)
    assert s.requests["long4"].state is State.QUEUED  # long3 is not answered yet
    assert _dispatched(s.first_token("long3", 3.5)) == {}  # short's prompt is still pending
    assert _dispatched(s.first_token("short", 3.6)) == {"long4": "a"}


def _itl(at: float, seconds: float, tokens: int) -> LoadSignals:
    return LoadSignals(at=at, itl_seconds_total=seconds, itl_tokens_total=tokens)


def test_the_tpot_guard_holds_the_other_classes_off_a_slow_replica_streaming_realtime() -> None:
    """Realtime's TPOT budget is 200 ms: with the guard at 0.5, an engine whose mean time per
    output token between two scrapes passes 100 ms takes no new request of the other classes
    while it streams to realtime (beyond one at a time), until it is back under 75 ms;
    realtime itself always goes."""
    s = _sched(ReplicaSpec("a", 8), ReplicaSpec("b", 8),
               fleet=Fleet(prefill_budget_tokens=None, tpot_guard=0.5))
    s.observe("b", 0.0, up=False)  # only a can take work
    s.observe("a", 0.0, signals=_itl(0.0, 0.0, 0))
    assert _dispatched(_submit(s, "rt", now=0.1, cls="realtime")) == {"rt": "a"}
    s.first_token("rt", 0.2)
    s.observe("a", 1.0, signals=_itl(1.0, 12.0, 100))  # 120 ms a token: past the guard
    assert s.replicas["a"].itl_s == 0.12 and s.replicas["a"].others_held
    # held, but nothing of the other classes runs there: one at a time still goes (without
    # this, an engine too slow for realtime even alone would starve them while it streams)
    assert _dispatched(_submit(s, "bg", now=1.05, cls="batch")) == {"bg": "a"}
    assert _dispatched(_submit(s, "api1", now=1.1)) == {}  # held in qosgate
    assert _dispatched(_submit(s, "rt2", now=1.2, cls="realtime")) == {"rt2": "a"}
    s.observe("a", 2.0, signals=_itl(2.0, 21.0, 200))  # 90 ms: under the guard, not under 75
    assert s.requests["api1"].state is State.QUEUED
    out = s.observe("a", 3.0, signals=_itl(3.0, 28.0, 300))  # 70 ms: released
    assert _dispatched(out) == {"api1": "a"}
    s.observe("a", 4.0, signals=_itl(4.0, 40.0, 400))  # held again
    s.observe("b", 4.0, up=True)
    assert _dispatched(_submit(s, "api2", now=4.1)) == {"api2": "b"}  # another replica takes it
    s.complete("rt", 5.0, 20)
    s.complete("rt2", 5.0, 20)
    s.complete("bg", 5.0, 20)
    # no realtime stream on a: nothing to protect, whatever its engine's pace
    s.observe("b", 5.0, up=False)
    assert _dispatched(_submit(s, "api3", now=5.1)) == {"api3": "a"}


def test_what_a_held_replica_does_not_take_does_not_pile_onto_one_near_its_guard() -> None:
    s = _sched(ReplicaSpec("a", 8), ReplicaSpec("b", 8),
               fleet=Fleet(prefill_budget_tokens=None, tpot_guard=0.5))
    for name in ("a", "b"):
        s.observe(name, 0.0, signals=_itl(0.0, 0.0, 0))
    for rid in ("rt-a", "rt-b"):
        _submit(s, rid, now=0.1, cls="realtime")
        s.first_token(rid, 0.2)
    assert {s.requests[r].replica for r in ("rt-a", "rt-b")} == {"a", "b"}
    held = s.requests["rt-a"].replica
    near = "b" if held == "a" else "a"
    s.observe(held, 1.0, signals=_itl(1.0, 15.0, 100))  # 150 ms: held
    s.observe(near, 1.0, signals=_itl(1.0, 8.0, 100))  # 80 ms: under the guard, not under 75
    assert _dispatched(_submit(s, "bg", now=1.05, cls="batch")) == {"bg": held}  # one at a time
    assert _dispatched(_submit(s, "api1", now=1.1)) == {}
    out = s.observe(near, 2.0, signals=_itl(2.0, 14.0, 200))  # 60 ms: well under
    assert _dispatched(out) == {"api1": near}


def test_the_tpot_guard_is_off_by_default_and_for_a_class_blind_policy() -> None:
    s = _sched(ReplicaSpec("a", 8), fleet=Fleet(prefill_budget_tokens=None))
    _submit(s, "rt", cls="realtime")
    s.first_token("rt", 0.1)
    s.observe("a", 1.0, signals=_itl(1.0, 0.0, 0))
    s.observe("a", 2.0, signals=_itl(2.0, 50.0, 100))  # 500 ms a token: read, not acted on
    assert s.replicas["a"].itl_s == 0.5 and not s.replicas["a"].others_held
    assert _dispatched(_submit(s, "api", now=2.1)) == {"api": "a"}
    fifo = Scheduler(default_config(fleet=Fleet(tpot_guard=0.5)), "fifo",
                     [ReplicaSpec("a", 8, window_mode="fixed")])
    fifo.observe("a", 1.0, signals=_itl(1.0, 0.0, 0))
    fifo.observe("a", 2.0, signals=_itl(2.0, 50.0, 100))
    assert not fifo.replicas["a"].others_held


def test_the_learned_guard_tightens_only_once_realtime_streams_miss_their_budget() -> None:
    """``auto`` starts at 1.5 x realtime's 200 ms: an engine at 250 ms a token is not held.
    Sixteen realtime streams that ended on it at 300 ms a token (past the budget) tighten its
    guard to 1.125 (225 ms), and the same 250 ms now holds the other classes off."""
    s = _sched(ReplicaSpec("a", 64), fleet=Fleet(prefill_budget_tokens=None, tpot_guard="auto"))
    s.observe("a", 0.0, signals=_itl(0.0, 0.0, 0))
    _submit(s, "rt-live", now=0.1, cls="realtime")
    s.first_token("rt-live", 0.2)
    s.observe("a", 1.0, signals=_itl(1.0, 25.0, 100))  # 250 ms a token
    assert not s.replicas["a"].others_held
    guard = s.replicas["a"].guard
    assert guard is not None and guard.fraction == 1.5
    for i in range(16):
        _submit(s, f"rt{i}", now=1.0, cls="realtime")
        s.first_token(f"rt{i}", 1.1)
        s.complete(f"rt{i}", 1.1 + 19 * 0.3, 20)  # 20 tokens at 300 ms: 1.5x the budget
    assert guard.fraction == 1.125
    s.observe("a", 8.0, signals=_itl(8.0, 50.0, 200))  # 250 ms again: now past 225 ms
    assert s.replicas["a"].others_held
    assert _dispatched(_submit(s, "api", now=8.1)) == {"api": "a"}  # one at a time
    assert _dispatched(_submit(s, "api2", now=8.2)) == {}


def test_a_class_held_next_to_free_room_is_predicted_to_wait() -> None:
    """Free slots the prefill budget keeps a class out of are not room for it: admission
    predicts its wait from the rate it is served at (before, a backlog shorter than the free
    room predicted no wait at all, and its requests were admitted to time out)."""
    s = _sched(ReplicaSpec("a", 64), fleet=Fleet(prefill_budget_tokens=1000))
    _submit(s, "rt", cls="realtime")
    s.first_token("rt", 0.1)
    for i in range(12):
        _submit(s, f"long{i}", now=0.2, prompt=1500)
    for i in range(5):  # answered one by one: each lets the next go (one at a time)
        s.first_token(f"long{i}", 0.5 + 0.5 * i)
    assert s.queued_total == 6 and s.free_slots > 6  # a backlog beside free room
    wait = s.predicted_wait(s.requests["long11"].level, 2.6)
    assert wait is not None and wait > 2.0  # six ahead, served about two a second


def test_gateways_sharing_an_engine_share_its_prefill_budget() -> None:
    """Each gateway bounds only what it sent itself: four gateways with a budget of 2,000 each
    would put 8,000 tokens of the other classes' prefill next to realtime's decode. A gateway
    keeps its share of the budget: what it has in flight over what the engine holds."""
    s = _sched(ReplicaSpec("a", 64), fleet=Fleet(prefill_budget_tokens=2000))
    _submit(s, "rt", cls="realtime")
    s.first_token("rt", 0.1)
    assert _dispatched(_submit(s, "p1", now=0.2, prompt=600)) == {"p1": "a"}
    # the engine holds 8 sequences, 2 of them this gateway's: a quarter of the budget, 500
    s.observe("a", 0.3, signals=LoadSignals(at=0.3, running=8, waiting=0))
    assert s.replicas["a"].engine_share == 0.25
    assert _dispatched(_submit(s, "p2", now=0.4, prompt=100)) == {}  # 700 > 500: held
    s.observe("a", 0.5, signals=LoadSignals(at=0.5, running=2, waiting=0))  # alone again
    assert s.requests["p2"].replica == "a"  # 700 <= 2000



def _count_pops(s: Scheduler) -> list[int]:
    """Count the pops of ``s``'s queue from now on (in the one-item list returned)."""
    pops = [0]
    pop = s.policy.pop

    def counting_pop() -> object:
        pops[0] += 1
        return pop()

    s.policy.pop = counting_pop  # type: ignore[assignment]
    return pops

def test_a_spent_prefill_budget_leaves_the_queue_alone() -> None:
    """While the budget is spent on every replica with room, a fill pops nothing (each pop
    and re-queue cost a fill under load up to 32 of them); once a prompt is answered, the
    queue moves again."""
    s = _sched_small(ReplicaSpec("a", 8), fleet=Fleet(prefill_budget_tokens=1000))
    _submit(s, "rt", cls="realtime")
    s.first_token("rt", 0.1)
    assert _dispatched(_submit(s, "long", now=0.2, prompt=1500)) == {"long": "a"}
    pops = _count_pops(s)
    for i in range(5):
        assert _dispatched(_submit(s, f"b{i}", now=0.3, prompt=100)) == {}
    assert pops == [0]
    assert _dispatched(_submit(s, "rt2", now=0.4, cls="realtime")) == {"rt2": "a"}
    assert _dispatched(s.first_token("long", 0.5)) == {"b0": "a", "b1": "a", "b2": "a",
                                                      "b3": "a", "b4": "a"}


def test_a_window_shrinks_to_its_share_of_an_engine_other_gateways_feed_too() -> None:
    from qosgate.core.windows import AdaptiveWindow

    alone = AdaptiveWindow(64, max_window=64, cooldown_s=0.0)
    shared = AdaptiveWindow(64, max_window=64, cooldown_s=0.0)
    for t in (1.0, 2.0):  # a queue seen in two samples in a row
        alone.on_signals(t, LoadSignals(at=t, running=60, waiting=20), inflight=80)
        # 20 of the 80 requests the engine holds are this gateway's: a quarter of its batch
        shared.on_signals(t, LoadSignals(at=t, running=60, waiting=20), inflight=20)
    assert alone.window == 63  # all it runs plus the allowance (5% of 64)
    assert shared.window == 15


def test_a_queue_seen_in_one_sample_only_is_arrivals_between_engine_steps() -> None:
    # requests sent after the engine's last step count as waiting until its next one: on a
    # small window (allowance 1) that looked like a full batch at every other scrape and kept
    # the window at what it had sent, with the queue held in the gateway (a real-speed probe)
    from qosgate.core.windows import AdaptiveWindow

    lim = AdaptiveWindow(20, max_window=1024, settle_s=2.0, cooldown_s=0.0)
    lim._slow_start = False
    for t in range(1, 13):
        waiting = 3 if t % 2 else 0  # a transient queue at every other scrape
        lim.on_signals(float(t), LoadSignals(at=float(t), running=20, waiting=waiting), 20)
    assert lim.window > 20  # grew: never shrunk, and the lone samples did not reset settling
    before = lim.window
    full = LoadSignals(at=20.0, running=before - 5, waiting=3)  # it runs fewer than it holds
    lim.on_signals(20.0, full, before - 2)
    lim.on_signals(20.5, full, before - 2)  # the same sample read again
    assert lim.window == before
    lim.on_signals(21.0, LoadSignals(at=21.0, running=before - 5, waiting=3), before - 2)
    assert lim.window == before - 4  # a queue in two fresh samples: what it runs + 1


def test_an_adaptive_window_follows_the_engine_signals() -> None:
    from qosgate.core.windows import AdaptiveWindow

    lim = AdaptiveWindow(4, max_window=64, settle_s=1.0, cooldown_s=1.0)
    t = 0.0
    for _ in range(3):  # slow start: doubles while full and settled
        lim.on_signals(t, LoadSignals(at=t, waiting=0, kv_usage=0.5), inflight=lim.window)
        t += 1.0
        lim.on_signals(t, LoadSignals(at=t, waiting=0, kv_usage=0.5), inflight=lim.window)
    assert lim.window == 32
    lim.on_signals(t, LoadSignals(at=t, waiting=0, kv_usage=0.5), inflight=3)  # not full
    t += 5.0
    lim.on_signals(t, LoadSignals(at=t, waiting=0, kv_usage=0.5), inflight=3)
    assert lim.window == 32  # no growth while the window is not full
    t += 1.0
    lim.on_signals(t, LoadSignals(at=t, waiting=10, kv_usage=0.5), inflight=32)  # engine queue
    assert lim.window == 32  # once: maybe arrivals between two steps
    t += 1.0
    lim.on_signals(t, LoadSignals(at=t, waiting=10, kv_usage=0.5), inflight=32)  # still there
    assert lim.window == 25
    lim.on_signals(t + 0.5, LoadSignals(at=t + 0.5, kv_usage=0.99), inflight=25)
    assert lim.window == 25  # within the cooldown: the last change has not shown yet
    lim.on_signals(t + 1.5, LoadSignals(at=t + 1.5, preemptions_total=3), inflight=25)
    lim.on_signals(t + 3.0, LoadSignals(at=t + 3.0, preemptions_total=4), inflight=25)
    assert lim.window == 20  # new engine preemptions: pressure
    t += 10.0
    lim.on_signals(t, LoadSignals(at=t - 9, waiting=0), inflight=20)  # stale: ignored
    assert lim.window == 20
    lim.on_signals(t, LoadSignals(at=t, waiting=0, preemptions_total=4), inflight=20)
    lim.on_signals(t + 1, LoadSignals(at=t + 1, waiting=0, preemptions_total=4), inflight=20)
    assert lim.window == 22  # after pressure: additive growth (10%)


def test_an_adaptive_window_grows_when_the_queue_fills_all_but_the_reserved_share() -> None:
    # api may not use realtime's reserved share (10% of the window): with only api queued, a
    # window of 30 holds 27 in flight and 3 kept free. That is full for api; before the fix the
    # window counted it as not full (27 < 29) and never grew, however idle the engine
    s = Scheduler(default_config(fleet=Fleet(window=Window(initial=30, settle_s=1.0,
                                                              cooldown_s=1.0))),
                  "qos", [ReplicaSpec("a", 256, window_mode="adaptive")])
    for i in range(100):
        _submit(s, f"api{i}")
    rep = s.replicas["a"]
    assert (rep.window, len(rep.inflight)) == (30, 27)
    for t in range(1, 4):
        s.observe("a", float(t), up=True,
                  signals=LoadSignals(at=float(t), waiting=0, kv_usage=0.3, preemptions_total=0))
    assert rep.window > 30 and len(rep.inflight) > 27
    # and it still does not grow while the queue leaves room it could use
    s2 = Scheduler(default_config(fleet=Fleet(window=Window(initial=30, settle_s=1.0))),
                   "qos", [ReplicaSpec("a", 256, window_mode="adaptive")])
    for i in range(20):
        _submit(s2, f"api{i}")
    for t in range(1, 4):
        s2.observe("a", float(t), up=True, signals=LoadSignals(at=float(t), waiting=0))
    assert s2.replicas["a"].window == 30


def test_a_suspect_replica_gets_one_unanswered_request_at_a_time() -> None:
    """A replica whose calls just broke (it may have died) is not handed the whole queue before
    a refused connection can say so: one request at a time until a call there succeeds."""
    s = _sched_small(ReplicaSpec("a", 8, models=("m",)), ReplicaSpec("b", 2, models=("m",)),
               fleet=Fleet(router="most-free"))
    for i in range(30):
        _submit(s, f"r{i}", model="m")
    a = s.replicas["a"]
    assert len(a.inflight) == 8
    streams = list(a.inflight)
    for rid in streams:
        s.first_token(rid, 1.0)
    for rid in streams:  # every stream on a breaks mid-way
        s.fail(rid, 1.1, "upstream_disconnected")
    assert a.failing and a.pending == 1 and len(a.inflight) == 1  # one probe, not eight
    probe = next(iter(a.inflight))
    s.first_token(probe, 1.5)  # it answers: no longer suspect
    assert not a.failing and len(a.inflight) == 8  # its whole window again


def test_a_request_paused_on_a_suspect_replica_resumes_only_once_its_call_is_answered() -> None:
    """A paused request resumes only where its state lives, but a suspect replica's one
    unanswered request at a time holds for it too: else it took the slot past a realtime
    retry that the rule held, and a replica just broken got every paused request at once."""
    s = _sched(ReplicaSpec("p", 2, pausable=True))
    _submit(s, "b0", cls="batch")
    _submit(s, "rt0", cls="realtime")
    # a realtime arrival pulls b0 back (paused on p: it resumes there only) and takes its slot
    assert _dispatched(_submit(s, "rt1", cls="realtime")) == {"rt1": "p"}
    p = s.replicas["p"]
    # rt0's call fails before its first byte: p is suspect while rt1 is unanswered, so neither
    # rt0's retry nor the paused b0 goes there
    assert _dispatched(s.attempt_failed("rt0", 0.5, AttemptFailed("upstream_500"))) == {}
    assert p.failing and p.free == 1 and s.requests["b0"].state is State.QUEUED
    # rt1 answers: p is trusted again, and realtime goes first
    assert _dispatched(s.first_token("rt1", 0.6)) == {"rt0": "p"}


def test_a_request_paused_in_the_reserve_resumes_there_only_while_api_does_not_wait() -> None:
    """The reserve is lent only while no class that may not borrow it waits, to a request
    resuming where it was paused too: else batch took the reserved slot past a waiting api."""
    s = _sched(ReplicaSpec("p", 10, pausable=True))  # realtime keeps one slot of ten
    _submit(s, "b0", cls="batch")
    for i in range(9):
        _submit(s, f"rt{i}", cls="realtime")
    assert _dispatched(_submit(s, "rt9", cls="realtime")) == {"rt9": "p"}  # b0 paused
    _submit(s, "api0")
    # one slot frees: the reserve's, which api may not take; b0 may not borrow it while api
    # waits
    assert _dispatched(s.complete("rt0", 1.0, 5)) == {}
    # another frees: api takes the room beyond the reserve, then b0 may borrow it
    assert _dispatched(s.complete("rt1", 1.1, 5)) == {"api0": "p", "b0": "p"}


def test_least_load_spread_spreads_realtime_and_steers_it_off_a_slow_replica() -> None:
    """With the prefill budget holding the other classes off a replica that streams realtime,
    plain least-load sends the next realtime request to that replica again (it looks least
    loaded); least-load-spread counts its realtime streams and sends it to the other one, and
    keeps realtime off a replica whose engine runs past realtime's 200 ms TPOT budget. Other
    classes are placed as by least-load."""
    def fleet(router: str) -> Scheduler:
        s = _sched(ReplicaSpec("a", 10), ReplicaSpec("b", 10),
                   fleet=Fleet(router=router, prefill_budget_tokens=100))
        _submit(s, "rt0", cls="realtime")
        s.first_token("rt0", 0.1)
        where = s.requests["rt0"].replica
        other = "b" if where == "a" else "a"
        _submit(s, "bulk", now=0.2, prompt=50)  # goes where realtime does not stream
        assert s.requests["bulk"].replica == other
        return s

    plain, spread = fleet("least-load"), fleet("least-load-spread")
    assert _dispatched(_submit(plain, "rt1", now=0.3, cls="realtime")) == {
        "rt1": plain.requests["rt0"].replica}  # piles onto the replica it streams on
    assert _dispatched(_submit(spread, "rt1", now=0.3, cls="realtime")) == {
        "rt1": spread.requests["bulk"].replica}  # spread
    # the replica realtime would go to next runs past its budget: realtime goes elsewhere
    s = _sched(ReplicaSpec("a", 10), ReplicaSpec("b", 10), fleet=Fleet(router="least-load-spread"))
    for name, seconds in (("a", 30.0), ("b", 40.0)):  # a: 300 ms a token, b: 400 ms
        s.observe(name, 0.0, signals=_itl(0.0, 0.0, 0))
        s.observe(name, 1.0, signals=_itl(1.0, seconds, 100))
    s.observe("b", 2.0, signals=_itl(2.0, 45.0, 200))  # b: 50 ms a token now
    _submit(s, "bulk1", now=2.1)
    _submit(s, "bulk2", now=2.1)  # one on each: equal load
    assert _dispatched(_submit(s, "rt", now=2.2, cls="realtime")) == {"rt": "b"}
    assert _dispatched(_submit(s, "api", now=2.3)) == {"api": "a"}  # least-load's choice


def test_a_waiting_realtime_prompt_holds_the_other_classes_off_its_replica() -> None:
    """With ``strict_prompt_hold``, a replica whose realtime prompt has not been answered takes
    no new request of the other classes (the engine would put their prompts in realtime's
    prefill step); realtime's own prompts still go, and the queue moves once every realtime
    prompt there is answered."""
    s = _sched(ReplicaSpec("a", 8), fleet=Fleet(strict_prompt_hold=True))
    assert _dispatched(_submit(s, "rt", cls="realtime", prompt=1000)) == {"rt": "a"}
    assert _dispatched(_submit(s, "api", now=0.1)) == {}
    assert _dispatched(_submit(s, "batch", now=0.1, cls="batch")) == {}
    assert not s.may_take(s.replicas["a"], s.requests["api"], 0.1)
    assert _dispatched(_submit(s, "rt2", now=0.2, cls="realtime", prompt=500)) == {"rt2": "a"}
    assert _dispatched(s.first_token("rt", 0.3)) == {}  # rt2's prompt still waits
    assert _dispatched(s.first_token("rt2", 0.4)) == {"api": "a", "batch": "a"}


def test_the_prompt_hold_keeps_the_others_queued_rather_than_sent_elsewhere() -> None:
    """The router still picks the replica; if the one it picks holds, the request waits in
    qosgate for it rather than going to another (sending them all to the replicas with no
    realtime prompt cost the fleets more, docs/experiments/tpot-guard.md)."""
    s = _sched(ReplicaSpec("a", 8), ReplicaSpec("b", 8), fleet=Fleet(strict_prompt_hold=True))
    for i in range(4):  # spread over both
        assert _dispatched(_submit(s, f"old{i}")) == {f"old{i}": "ab"[i % 2]}
        s.first_token(f"old{i}", 0.05)
    s.complete("old0", 0.06, 5)
    s.complete("old2", 0.06, 5)  # b is the busier one now: two streams against none
    assert _dispatched(_submit(s, "rt", now=0.1, cls="realtime")) == {"rt": "a"}
    assert _dispatched(_submit(s, "api", now=0.2)) == {}  # a is the least loaded: held for it
    assert _dispatched(s.first_token("rt", 0.3)) == {"api": "a"}


def test_the_prompt_hold_is_off_by_default_and_never_under_fifo() -> None:
    for s in (_sched(ReplicaSpec("a", 8)),
              Scheduler(default_config(fleet=Fleet(strict_prompt_hold=True)), "fifo",
                        [ReplicaSpec("a", 8, window_mode="fixed")])):
        _submit(s, "rt", cls="realtime", prompt=1000)
        assert _dispatched(_submit(s, "api", now=0.1)) == {"api": "a"}


def test_a_held_queue_is_not_popped_while_the_realtime_prompt_waits() -> None:
    """While the only replica with room holds for a realtime prompt, a fill pops nothing (each
    pop and re-queue would cost, and serve nothing)."""
    s = _sched(ReplicaSpec("a", 8), fleet=Fleet(strict_prompt_hold=True))
    _submit(s, "rt", cls="realtime")
    pops = _count_pops(s)
    for i in range(5):
        assert _dispatched(_submit(s, f"b{i}", now=0.1)) == {}
    assert pops == [0]
    assert len(_dispatched(s.first_token("rt", 0.2))) == 5
