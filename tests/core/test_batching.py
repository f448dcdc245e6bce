"""The embeddings batcher (core/batching.py): pure, time passed in.

Properties: work-conserving unless a linger is open, and then for at most the ceiling;
every request released exactly once or removed exactly once; the linger stays within its floor
and ceiling. Examples: the adaptive linger grows under a steady stream that meets its target and
shrinks when batches miss it."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.core.batching import (
    AdaptiveLinger,
    Batch,
    Batcher,
    BatchLimits,
    FixedLinger,
    make_controller,
)


@dataclass
class Ev:
    kind: str  # add, remove, advance, finish
    dt: float = 0.0
    tokens: int = 1
    urgent: bool = False
    room: bool = True
    pick: int = 0


events = st.lists(
    st.one_of(
        st.builds(Ev, kind=st.just("add"), dt=st.floats(0, 0.05), tokens=st.integers(1, 900),
                  urgent=st.booleans(),
                  room=st.booleans()),
        st.builds(Ev, kind=st.just("remove"), pick=st.integers(0, 50)),
        st.builds(Ev, kind=st.just("advance"), dt=st.floats(0, 0.2)),
        st.builds(Ev, kind=st.just("finish"), dt=st.floats(0, 0.3), pick=st.integers(0, 50)),
    ),
    max_size=120,
)


def controllers() -> st.SearchStrategy[str]:
    return st.sampled_from(["off", "fixed", "adaptive"])


@settings(max_examples=300, deadline=None)
@given(events, controllers(), st.integers(1, 8), st.integers(1, 3000),
       st.floats(0.0, 0.2), st.integers(0, 2))
def test_work_conserving_unless_a_linger_is_open(
    evs: list[Ev], mode: str, max_batch: int, max_tokens: int, fixed: float, max_inflight: int
) -> None:
    ceiling = 0.1
    ctl = make_controller(mode, linger_s=fixed, floor_s=0.01, ceiling_s=ceiling,
                          target_s=0.05, every=2)
    bound = fixed if mode == "fixed" else ceiling if mode == "adaptive" else 0.0
    b = Batcher(BatchLimits(max_batch, max_tokens, max_inflight), ctl)
    now = 0.0
    ids = 0
    live: dict[str, float] = {}  # rid -> arrival, while pending
    ended: dict[str, str] = {}  # rid -> released / removed
    running: list[Batch] = []

    def release(room: bool) -> None:
        for batch in b.release(now, room):
            assert batch.rids, "an empty batch"
            assert len(batch.rids) <= max_batch
            assert batch.tokens <= max_tokens or len(batch.rids) == 1
            for rid in batch.rids:
                assert rid not in ended, "released twice"
                ended[rid] = "released"
                waited = now - live.pop(rid)
                if not max_inflight:  # never held beyond the linger, nor it beyond its bound
                    assert waited <= bound + 1e-9
            running.append(batch)
            if max_inflight and batch.why != "urgent":
                assert len(running) <= max_inflight
        # work-conserving unless a linger is open: what stays pending is only what a linger
        # (still open, within its bound) holds; nothing that must go is left behind
        if b.pending:
            assert not any(p.urgent for p in b.pending)  # realtime never waits
            if not (max_inflight and b.inflight >= max_inflight):  # else: the engine is busy
                assert room
                assert len(b.pending) < max_batch
                assert sum(p.tokens for p in b.pending) < max_tokens
                assert now < b.pending[0].arrived + b.linger_s
        assert 0.0 <= b.linger_s <= bound + 1e-12
        if mode == "adaptive":
            assert 0.01 - 1e-12 <= b.linger_s <= ceiling + 1e-12

    def advance(dt: float, room: bool) -> None:
        """Time passes; the runtime's one timer fires at each linger's end on the way."""
        nonlocal now
        end = now + dt
        while (d := b.deadline()) is not None and d <= end:
            now = max(now, d)
            release(room)
        now = end
        release(room)

    for ev in evs:
        if ev.kind == "add":
            advance(ev.dt, True)
            ids += 1
            rid = f"r{ids}"
            b.add(rid, ev.tokens, now, ev.urgent)
            live[rid] = now
            release(ev.room)
        elif ev.kind == "remove" and live:
            rid = sorted(live)[ev.pick % len(live)]
            assert b.remove(rid)
            assert not b.remove(rid)
            live.pop(rid)
            ended[rid] = "removed"
        elif ev.kind == "advance":
            advance(ev.dt, True)
        elif ev.kind == "finish" and running:
            batch = running.pop(ev.pick % len(running))
            advance(ev.dt, True)
            b.finished(now, batch)
    advance(1.0, True)
    while running:  # the batches in flight end; what waited for them goes
        b.finished(now, running.pop(0))
        advance(1.0, True)
    assert not b.pending and not live
    assert len(ended) == ids  # every request ended exactly once


def test_a_busy_engine_makes_the_next_batch() -> None:
    """max_inflight 1: while a batch runs, arrivals wait (no timer), then go as one batch."""
    b = Batcher(BatchLimits(max_inflight=1), FixedLinger(0.0))
    b.add("a", 1, 0.0)
    (first,) = b.release(0.0)
    for i in range(5):
        b.add(f"w{i}", 1, 0.001 * i)
        assert b.release(0.001 * i) == []
    assert b.deadline() is None  # nothing to wake up for: the batch's end will release
    b.finished(0.02, first)
    (nxt,) = b.release(0.02)
    assert nxt.rids == tuple(f"w{i}" for i in range(5))  # one batch of what waited
    b.add("x", 1, 0.021)
    b.add("rt", 1, 0.022, urgent=True)
    (rt,) = b.release(0.022)
    assert rt.why == "urgent" and rt.rids == ("x", "rt")  # realtime does not wait, takes x
    assert b.inflight == 2


def test_realtime_skips_the_linger() -> None:
    b = Batcher(BatchLimits(), FixedLinger(1.0))
    b.add("a", 5, 0.0)
    assert b.release(0.0) == []
    b.add("rt", 5, 0.01, urgent=True)
    (batch,) = b.release(0.01)
    assert batch.rids == ("a", "rt") and batch.why == "urgent"


def test_release_on_size_tokens_and_no_room() -> None:
    b = Batcher(BatchLimits(max_batch=3, max_tokens=100), FixedLinger(1.0))
    for i in range(3):
        b.add(f"s{i}", 1, 0.0)
    assert [x.why for x in b.release(0.0)] == ["size"]
    b.add("t0", 60, 0.0)
    b.add("t1", 60, 0.0)
    (batch,) = b.release(0.0)
    assert batch.why == "tokens" and batch.rids == ("t0",)  # the budget: t1 waits
    assert b.release(0.0) == []
    assert [x.rids for x in b.release(0.0, room=False)] == [("t1",)]


def steady(ctl: AdaptiveLinger, batches: int, size: int, latency: float) -> list[str]:
    out = []
    for i in range(batches):
        d = ctl.on_batch(float(i), size, latency)
        if d is not None:
            out.append(d.decision)
    return out


def test_adaptive_linger_grows_under_a_steady_stream() -> None:
    ctl = AdaptiveLinger(0.010, 0.100, 0.150, initial_s=0.010, every=10, alpha=0.5)
    seen = []
    for _ in range(10):  # batches of 8 meeting the target easily: the linger opens up
        seen += steady(ctl, 10, 8, 0.030 + ctl.linger_s)
    assert seen[0] == "grow"
    assert ctl.linger_s > 0.05
    assert ctl.linger_s <= 0.100


def test_adaptive_linger_shrinks_when_batches_miss_the_target() -> None:
    ctl = AdaptiveLinger(0.010, 0.100, 0.150, initial_s=0.100, every=10, alpha=0.5)
    seen = steady(ctl, 30, 16, 0.400)
    assert seen and all(d == "shrink" for d in seen)
    assert ctl.linger_s < 0.05
    seen = steady(ctl, 100, 16, 0.400)
    assert ctl.linger_s == pytest.approx(0.010)


def test_adaptive_linger_opens_when_the_latency_is_the_engines_queue() -> None:
    """Batches released while others still queue at the engine (no limit on batches in
    flight): the latency is the engine's backlog; a smaller linger would only make it worse."""
    ctl = AdaptiveLinger(0.010, 0.100, 0.150, initial_s=0.010, every=10, alpha=0.5)
    seen = []
    for i in range(60):
        d = ctl.on_batch(float(i), 4, 0.800, ahead=5)
        if d is not None:
            seen.append(d.decision)
    assert seen and all(d == "grow" for d in seen)
    assert ctl.linger_s > 0.05


def test_adaptive_linger_does_not_wait_for_nobody() -> None:
    """Batches of one (a sparse stream): a linger only adds latency; it goes to the floor."""
    ctl = AdaptiveLinger(0.010, 0.100, 0.150, initial_s=0.080, every=5, alpha=1.0)
    steady(ctl, 5, 1, 0.090)
    assert ctl.linger_s == pytest.approx(0.010)


def test_controller_arguments_are_checked() -> None:
    with pytest.raises(ValueError):
        make_controller("sometimes")
    with pytest.raises(ValueError):
        AdaptiveLinger(0.2, 0.1)
    with pytest.raises(ValueError):
        FixedLinger(-1)
