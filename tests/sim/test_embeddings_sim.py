"""The embeddings workload in virtual time (sim/embeddings.py): the gateway's batcher and
scheduler, a modelled engine; deterministic (seeded)."""

from __future__ import annotations

from qosgate.core.batching import AdaptiveLinger, BatchLimits, FixedLinger
from qosgate.sim.embeddings import EmbedWorkload, compare, simulate_embeddings, table


def test_every_request_completes_and_realtime_skips_the_linger() -> None:
    wl = EmbedWorkload(rate=40, seconds=10, seed=3, realtime_share=0.2)
    r = simulate_embeddings(wl, FixedLinger(0.100), BatchLimits(), "fixed 100 ms")
    assert r.completed == r.sent > 300
    # the engine calls ahead of it (~21 ms each), never the 100 ms linger
    assert r.pct(0.99, realtime=True) < 0.080
    assert r.pct(0.5) > 0.040  # the others do wait in the linger


def test_a_linger_beats_no_linger_when_calls_pile_up() -> None:
    """60/s against an engine that serves ~48 single calls/s: without a linger (and no limit
    on batches in flight) it saturates; any linger makes batches and keeps up."""
    off, w10, *_ = compare([60], seconds=10)
    assert off.throughput < 50 and off.pct(0.99) > 1.0
    assert w10.throughput > 58 and w10.pct(0.99) < 0.2


def test_adaptive_linger_moves_and_stays_in_bounds() -> None:
    wl = EmbedWorkload(rate=100, seconds=20, seed=5)
    ctl = AdaptiveLinger(0.010, 0.100, 0.150, initial_s=0.010)
    r = simulate_embeddings(wl, ctl, BatchLimits(), "adaptive")
    assert r.decisions.get("grow", 0) >= 1
    assert 0.010 <= r.linger_s <= 0.100
    assert r.completed == r.sent


def test_the_table_prints_every_row() -> None:
    out = table(compare([20, 60], seconds=3, max_inflight=1))
    assert out.count("\n") == 2 + 2 * 5 - 1
