"""Workload generation: arrival processes, length laws, the class/tenant mix, the trace reader."""

from __future__ import annotations

import itertools
import statistics
from collections import Counter
from pathlib import Path

import pytest

from qosgate.sim.workload import (
    TRACE_NAME,
    Constant,
    FromTrace,
    Lengths,
    LogNormal,
    Stream,
    Uniform,
    build_workload,
    draw_length,
    find_trace,
    read_trace,
)

CONST = Lengths(
    prompt=Constant(dist="constant", value=100), output=Constant(dist="constant", value=10)
)


def streams(*shares: float) -> list[Stream]:
    names = ("realtime", "api", "batch", "offline")
    return [Stream.model_validate({"share": s, "class": names[i]}) for i, s in enumerate(shares)]


def gaps(ts: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(ts)]


def test_poisson_rate_and_exponential_gaps() -> None:
    wl = build_workload(
        process="poisson",
        streams=streams(1),
        lengths=CONST,
        api_keys={},
        seed=7,
        duration=1000.0,
        rate=20.0,
    )
    n = len(wl.arrivals)
    assert abs(n - 20_000) < 4 * 20_000**0.5  # Poisson count: within 4 sigma
    g = gaps([a.t for a in wl.arrivals])
    cv = statistics.pstdev(g) / statistics.fmean(g)
    assert cv == pytest.approx(1.0, abs=0.05)
    assert all(0 <= a.t < 1000 for a in wl.arrivals)
    assert [a.t for a in wl.arrivals] == sorted(a.t for a in wl.arrivals)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_gap_variability(burstiness: float) -> None:
    wl = build_workload(
        process="gamma",
        streams=streams(1),
        lengths=CONST,
        api_keys={},
        seed=3,
        duration=2000.0,
        rate=10.0,
        burstiness=burstiness,
    )
    g = gaps([a.t for a in wl.arrivals])
    assert statistics.fmean(g) == pytest.approx(0.1, rel=0.05)
    # gamma with shape k: CV = 1/sqrt(k) (vLLM benchmark convention: 1 = Poisson)
    assert statistics.pstdev(g) / statistics.fmean(g) == pytest.approx(burstiness**-0.5, rel=0.1)


def test_mix_shares_are_respected() -> None:
    wl = build_workload(
        process="poisson",
        streams=streams(20, 30, 30, 20),
        lengths=CONST,
        api_keys={},
        seed=1,
        duration=1000.0,
        rate=20.0,
    )
    counts = Counter(a.stream for a in wl.arrivals)
    n = len(wl.arrivals)
    for i, share in enumerate((0.2, 0.3, 0.3, 0.2)):
        assert counts[i] / n == pytest.approx(share, abs=0.015)
    assert wl.inputs[0].qos_class == "realtime"


def test_same_seed_same_workload_other_seed_other() -> None:
    kw = dict(
        process="poisson",
        streams=streams(1, 1),
        lengths=Lengths(),
        api_keys={},
        duration=50.0,
        rate=5.0,
    )
    a = build_workload(seed=1, **kw)  # type: ignore[arg-type]
    b = build_workload(seed=1, **kw)  # type: ignore[arg-type]
    c = build_workload(seed=2, **kw)  # type: ignore[arg-type]
    assert a.arrivals == b.arrivals
    assert a.arrivals != c.arrivals


def test_length_laws() -> None:
    import random

    rng = random.Random(5)
    ln = LogNormal(dist="lognormal", mean=500, cv=1.0, max=100_000)
    xs = [draw_length(ln, rng) for _ in range(40_000)]
    assert statistics.fmean(xs) == pytest.approx(500, rel=0.03)
    assert statistics.pstdev(xs) / statistics.fmean(xs) == pytest.approx(1.0, rel=0.1)
    clamped = LogNormal(dist="lognormal", mean=500, cv=2.0, min=10, max=800)
    ys = [draw_length(clamped, rng) for _ in range(5000)]
    assert min(ys) >= 10 and max(ys) <= 800
    u = Uniform(dist="uniform", low=3, high=5)
    assert {draw_length(u, rng) for _ in range(200)} == {3, 4, 5}
    assert draw_length(Constant(dist="constant", value=9), rng) == 9
    with pytest.raises(ValueError):
        Uniform(dist="uniform", low=5, high=3)


def test_max_tokens_is_at_least_the_output() -> None:
    wl = build_workload(
        process="poisson",
        streams=streams(1),
        lengths=Lengths(),
        api_keys={},
        seed=1,
        duration=100.0,
        rate=5.0,
        max_tokens=256,
    )
    assert all(a.max_tokens == max(a.output, 256) for a in wl.arrivals)


def test_tenant_streams_use_the_tenant_api_key() -> None:
    s = [Stream(share=1, tenant="acme"), Stream(share=1, tenant="zeta", **{"class": "batch"})]
    wl = build_workload(
        process="poisson",
        streams=s,
        lengths=CONST,
        api_keys={"acme": "k1", "zeta": "k2"},
        seed=1,
        duration=10.0,
        rate=5.0,
    )
    assert wl.inputs[0].api_key == "k1" and wl.inputs[1].api_key == "k2"
    assert wl.inputs[1].qos_class == "batch"
    with pytest.raises(ValueError, match="tenant 'nobody'"):
        build_workload(
            process="poisson",
            streams=[Stream(share=1, tenant="nobody")],
            lengths=CONST,
            api_keys={},
            seed=1,
            duration=10.0,
            rate=5.0,
        )


TRACE_CSV = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 23:59:58.5000000,100,10
2023-11-16 23:59:59.0000000,200,0
2023-11-17 00:00:01.2500000,300,30
2023-11-17 00:00:03.5000000,400,40
"""


def test_trace_reader_and_time_scale(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text(TRACE_CSV)
    rows = read_trace(p)
    assert [r.t for r in rows] == pytest.approx([0.0, 0.5, 2.75, 5.0])  # across midnight
    assert [(r.prompt, r.output) for r in rows] == [(100, 10), (200, 1), (300, 30), (400, 40)]
    wl = build_workload(
        process="trace",
        streams=streams(1),
        lengths=Lengths(prompt=FromTrace(dist="trace"), output=FromTrace(dist="trace")),
        api_keys={},
        seed=1,
        duration=None,
        trace=rows,
        time_scale=2.0,
    )
    assert [a.t for a in wl.arrivals] == pytest.approx([0.0, 0.25, 1.375, 2.5])
    assert [a.prompt for a in wl.arrivals] == [100, 200, 300, 400]
    assert wl.duration == pytest.approx(2.5)
    # a duration cuts the replay
    cut = build_workload(
        process="trace",
        streams=streams(1),
        lengths=Lengths(),
        api_keys={},
        seed=1,
        duration=1.0,
        trace=rows,
        time_scale=2.0,
    )
    assert len(cut.arrivals) == 2


def test_trace_lengths_for_synthetic_arrivals_keep_pairs(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text(TRACE_CSV)
    rows = read_trace(p)
    wl = build_workload(
        process="poisson",
        streams=streams(1),
        lengths=Lengths(prompt=FromTrace(dist="trace"), output=FromTrace(dist="trace")),
        api_keys={},
        seed=1,
        duration=100.0,
        rate=5.0,
        trace=rows,
    )
    pairs = {(r.prompt, r.output) for r in rows}
    assert {(a.prompt, a.output) for a in wl.arrivals} <= pairs


def test_bad_trace_columns(tmp_path: Path) -> None:
    p = tmp_path / "bad.csv"
    p.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="expected columns"):
        read_trace(p)


def test_find_trace_walks_up_to_shared(tmp_path: Path) -> None:
    (tmp_path / "shared" / "traces").mkdir(parents=True)
    target = tmp_path / "shared" / "traces" / "x.csv"
    target.write_text(TRACE_CSV)
    repo = tmp_path / "main" / "src"
    repo.mkdir(parents=True)
    assert find_trace("x.csv", start=repo) == target
    with pytest.raises(FileNotFoundError, match="--trace"):
        find_trace("missing.csv", start=repo)


def test_the_azure_trace_when_present() -> None:
    try:
        path = find_trace(TRACE_NAME)
    except FileNotFoundError:
        pytest.skip("shared/traces is not beside this checkout")
    rows = read_trace(path)
    assert len(rows) == 19_366
    assert rows[-1].t == pytest.approx(3501.7, abs=1.0)
