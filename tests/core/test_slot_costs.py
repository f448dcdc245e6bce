"""A replica serving models of unequal weight counts its window in cost (``core.slot_costs``):
a heavy model's requests hold more of it, so they cannot fill what the light model's realtime
needs; the reserved share is kept in the same unit. With one model per replica nothing
changes."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.config import ModelSpec, default_config
from qosgate.core import Dispatch, QosInputs, ReplicaSpec, Scheduler, State
from qosgate.core.decisions import Decision
from qosgate.core.signals import LoadSignals
from qosgate.core.slot_costs import slot_costs
from qosgate.core.weights import ModelWeights
from tests.support.classes import with_reserve

LIGHT, HEAVY = "light", "heavy"
MODELS = (ModelSpec(name=LIGHT), ModelSpec(name=HEAVY, weight=10.0))


def _sched(*specs: ReplicaSpec, reserve: float = 0.0, **cfg: Any) -> Scheduler:
    for spec in specs:
        spec.window_mode = "fixed"
    cfg.setdefault("models", MODELS)
    return Scheduler(default_config(classes=with_reserve(reserve), **cfg), "qos", list(specs))


def _submit(s: Scheduler, rid: str, model: str, cls: str = "api",
            now: float = 0.0) -> list[Decision]:
    req = s.make_request(rid, QosInputs(qos_class=cls), now, 10, 100, model)
    return s.submit(req, now)


def _sent(ds: list[Decision]) -> list[str]:
    return [d.req.id for d in ds if isinstance(d, Dispatch)]


def test_a_model_holds_its_output_weight_over_the_replicas_lightest_in_slots() -> None:
    weights = ModelWeights((*MODELS, ModelSpec(name="mid", weight=2.4)))
    assert slot_costs((LIGHT, HEAVY, "mid"), weights) == {HEAVY: 10, "mid": 2}
    # relative to the lightest model it serves: without the light one, mid is the unit
    assert slot_costs((HEAVY, "mid"), weights) == {HEAVY: 4}
    # one model, or models of one weight, or no weights: one slot per request
    assert slot_costs((HEAVY,), weights) == {}
    assert slot_costs((LIGHT, "other"), weights) == {}
    assert slot_costs((LIGHT, HEAVY), ModelWeights(())) == {}


def test_heavy_requests_fill_a_shared_window_by_their_cost_not_their_count() -> None:
    s = _sched(ReplicaSpec("both", 20, models=(LIGHT, HEAVY)))
    sent = []
    for i in range(2):
        sent += _sent(_submit(s, f"h{i}", HEAVY, cls="batch"))
    assert sent == ["h0", "h1"]  # two heavy requests are the whole window of 20
    rep = s.replicas["both"]
    assert (rep.held, rep.free, s.free_slots) == (20, 0, 0)
    assert _sent(_submit(s, "l0", LIGHT)) == []  # the light model waits for room
    # one heavy request ends: its ten slots go to the light one (and nine more could follow)
    assert _sent(s.complete("h0", 1.0, 5)) == ["l0"]
    assert (rep.held, s.free_slots) == (11, 9)


def test_the_reserved_share_is_kept_in_slots_of_cost_from_heavy_work() -> None:
    """Counted in requests, the heavy batch would take all but the reserve's two slots of the
    twenty; counted in cost, the ten slots beyond the reserve that the light requests leave fit
    one heavy request, and batch is never lent the reserve for another."""
    s = _sched(ReplicaSpec("both", 20, models=(LIGHT, HEAVY)), reserve=0.1)
    sent = []
    for i in range(8):
        sent += _sent(_submit(s, f"a{i}", LIGHT))
    for i in range(3):
        sent += _sent(_submit(s, f"h{i}", HEAVY, cls="batch"))
    assert sent == [f"a{i}" for i in range(8)] + ["h0"]
    rep = s.replicas["both"]
    assert (rep.held, rep.free) == (18, 2)  # the reserve's two slots are free
    assert _sent(_submit(s, "rt0", LIGHT, cls="realtime")) == ["rt0"]
    assert s.requests["h1"].state is State.QUEUED and s.preemptions["batch"] == 0


def test_a_request_costlier_than_the_whole_window_still_runs_alone() -> None:
    s = _sched(ReplicaSpec("both", 4, models=(LIGHT, HEAVY)))
    assert _sent(_submit(s, "h0", HEAVY)) == ["h0"]
    assert _sent(_submit(s, "l0", LIGHT)) == []
    assert _sent(s.complete("h0", 1.0, 5)) == ["l0"]
    assert _sent(_submit(s, "h1", HEAVY)) == []  # it waits for the window to empty


def test_a_replica_of_the_heavy_model_alone_holds_one_slot_per_request() -> None:
    """Its window is sized by its engine's own signals (the adaptive window), which already see
    a heavy model's smaller batch: dividing it by the weight again would count it twice."""
    s = _sched(ReplicaSpec("heavy", 4, models=(HEAVY,)), ReplicaSpec("light", 4, models=(LIGHT,)))
    sent = []
    for i in range(5):
        sent += _sent(_submit(s, f"h{i}", HEAVY, cls="batch"))
    assert sent == [f"h{i}" for i in range(4)]
    assert s.replicas["heavy"].held == 4


def test_a_learned_weight_resizes_the_slots_of_requests_placed_after_it() -> None:
    auto = (ModelSpec(name=LIGHT), ModelSpec(name=HEAVY, weight="auto"))
    s = _sched(ReplicaSpec("both", 20, models=(LIGHT, HEAVY)), models=auto)
    assert _sent(_submit(s, "h0", HEAVY)) == ["h0"]
    weights = s.pricing.weights
    weights.measured(LIGHT, 0.001, 0.01)
    weights.measured(HEAVY, 0.01, 0.05)
    s.observe("both", 1.0, up=True)  # (a probe or scrape after a measurement recounts)
    assert _sent(_submit(s, "h1", HEAVY, now=1.0)) == ["h1"]
    rep = s.replicas["both"]
    assert rep.held == 1 + 5  # the first keeps the one slot it was placed with
    assert _sent(s.complete("h0", 2.0, 5)) == [] and rep.held == 5


# ---------------------------------------------------------------- one model: nothing changes
_CLASSES = ("realtime", "api", "batch", "offline")
_op = st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(_CLASSES), st.integers(1, 400)),
    st.tuples(st.just("first"), st.integers(0, 1000), st.just(0)),
    st.tuples(st.just("complete"), st.integers(0, 1000), st.integers(1, 300)),
)


def _run(models: tuple[ModelSpec, ...], ops: list[tuple[str, Any, int]]) -> list[tuple[str, str]]:
    """The dispatches of ``ops`` on two replicas of one model (window 8, realtime's default
    reserve), under ``models``' weights."""
    specs = [ReplicaSpec(n, 8, models=(HEAVY,), window_mode="fixed") for n in ("a", "b")]
    s = Scheduler(default_config(models=models), "qos", specs)
    out: list[tuple[str, str]] = []
    now = 0.0
    for i, (kind, arg, n) in enumerate(ops):
        now += 0.01
        if kind == "submit":
            req = s.make_request(f"r{i}", QosInputs(qos_class=arg), now, n, 200, HEAVY)
            ds = s.submit(req, now)
        else:
            live = sorted(s.requests.values(), key=lambda r: r.id)
            wanted = State.DISPATCHED if kind == "first" else State.RUNNING
            chosen = [r for r in live if r.state is wanted]
            if not chosen:
                continue
            rid = chosen[arg % len(chosen)].id
            ds = s.first_token(rid, now) if kind == "first" else s.complete(rid, now, n)
        out += [(d.req.id, d.replica) for d in ds if isinstance(d, Dispatch)]
        for rep in s.replicas.values():  # the window in cost is the window in requests
            assert rep.held == len(rep.inflight)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(_op, min_size=1, max_size=80))
def test_with_one_model_a_weighted_window_admits_what_a_counted_one_does(
        ops: list[tuple[str, Any, int]]) -> None:
    """A weight that is a power of two scales every cost exactly, so fair share and admission
    decide alike with and without it: only the windows could differ, and they may not."""
    assert _run((ModelSpec(name=HEAVY, weight=8.0),), ops) == _run((), ops)


def test_a_replica_that_comes_to_serve_one_model_holds_one_slot_per_request_again() -> None:
    s = _sched(ReplicaSpec("both", 20, models=(LIGHT, HEAVY)))
    assert s.replicas["both"].costs == {HEAVY: 10}
    s.observe("both", 1.0, models=[HEAVY])  # its /v1/models now lists the heavy one alone
    assert s.replicas["both"].costs == {}
    assert _sent(_submit(s, "h0", HEAVY, now=1.0)) == ["h0"] and s.replicas["both"].held == 1


def test_a_heavy_request_waits_while_no_replica_has_room_for_its_cost() -> None:
    """Both routers check a request's slots, not one free slot: eight free slots on each
    replica are no room for a heavy request of ten."""
    for router in ("least-load", "most-free"):
        s = _sched(ReplicaSpec("a", 12, models=(LIGHT, HEAVY)),
                   ReplicaSpec("b", 12, models=(LIGHT, HEAVY)), fleet={"router": router})
        for i in range(8):
            _submit(s, f"l{i}", LIGHT)
        assert [r.held for r in s.replicas.values()] == [4, 4]
        assert _sent(_submit(s, "h0", HEAVY)) == []
        on_a = sorted(r.id for r in s.replicas["a"].inflight.values())
        s.complete(on_a[0], 1.0, 5)
        assert _sent(s.complete(on_a[1], 1.0, 5)) == ["h0"]  # a has ten free now
        assert s.requests["h0"].replica == "a"


def test_an_adaptive_window_counted_in_cost_reads_the_engines_queue_in_slots() -> None:
    """The engine counts sequences: two heavy ones running and three waiting are twenty and
    thirty slots of a window that counts cost (read as two and three, the window would come
    down to three slots, less than one heavy request)."""
    spec = ReplicaSpec("both", 64, models=(LIGHT, HEAVY), window_mode="adaptive")
    cfg = default_config(classes=with_reserve(0.0), models=MODELS,
                         fleet={"window": {"initial": 64}})
    s = Scheduler(cfg, "qos", [spec])
    for i in range(5):
        _submit(s, f"h{i}", HEAVY, cls="batch")
    rep = s.replicas["both"]
    assert (rep.held, len(rep.inflight)) == (50, 5)
    for at in (10.0, 11.0):  # a queue in two fresh samples: the batch is full
        s.observe("both", at, signals=LoadSignals(at=at, running=2, waiting=3, kv_usage=0.5))
    assert 20 <= rep.window < 50  # what it runs, two heavy requests, and a small queue


def test_the_room_a_heavy_request_needs_adds_up_however_much_lighter_work_follows() -> None:
    """Its turn come (here: it is older), the slots that free are kept for it until it fits:
    else each light request behind it took the one slot that freed, as long as they came."""
    s = _sched(ReplicaSpec("both", 20, models=(LIGHT, HEAVY)), reserve=0.1)
    for i in range(18):  # the window beyond realtime's two reserved slots, in light requests
        _submit(s, f"l{i}", LIGHT)
    assert _sent(_submit(s, "h0", HEAVY, now=0.1)) == []
    done, sent, later = 0, [], 18
    while "h0" not in sent:
        _submit(s, f"l{later}", LIGHT, now=1.0 + done)  # lighter work keeps arriving
        later += 1
        sent = _sent(s.complete(f"l{done}", 1.0 + done, 5))
        done += 1
        assert done <= 10, "the heavy request never found its ten slots"
    assert done == 10
    # realtime still finds its reserve meanwhile
    assert _sent(_submit(s, "rt", LIGHT, cls="realtime", now=20.0)) == ["rt"]
