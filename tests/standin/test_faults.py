"""The stand-in's fault switches, without a server: spec parsing, the JSON form, and what is on
when (a fake clock)."""

from __future__ import annotations

import pytest

from qosgate.standin.calls import cut_stream as _cut_stream
from qosgate.standin.faults import (
    KINDS,
    Fault,
    FaultError,
    FaultSwitch,
    fault_from_json,
    parse_fault,
)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize(
    ("spec", "expect"),
    [
        ("die", Fault("die")),
        ("die:after=2.5", Fault("die", after=2.5)),
        ("refuse:for=3", Fault("refuse", for_s=3.0)),
        ("hang-first-byte", Fault("hang-first-byte")),
        ("hang-first-byte:count=2:at=1", Fault("hang-first-byte", count=2, at_s=1.0)),
        ("hang-mid-stream:after=4", Fault("hang-mid-stream", after=4.0)),
        ("slow:factor=3", Fault("slow", factor=3.0)),
        ("429:retry-after=2:for=10", Fault("429", retry_after=2.0, for_s=10.0)),
        ("503", Fault("503", retry_after=1.0)),
        ("503:retry-after=none", Fault("503", retry_after=None)),
        (" 429 : Retry-After = 0.5 ", Fault("429", retry_after=0.5)),
    ],
)
def test_specs_parse_and_round_trip(spec: str, expect: Fault) -> None:
    f = parse_fault(spec)
    assert f == expect
    assert parse_fault(f.spec()) == f


@pytest.mark.parametrize(
    "spec",
    [
        "explode",  # unknown kind
        "slow",  # needs a factor
        "slow:factor=0",
        "slow:factor=-1",
        "429:retry-after=soon",
        "429:count=0",
        "429:count=1.5",
        "die:for=3",  # not an option of die
        "hang-mid-stream:after=1.5",  # chunks are whole
        "hang-first-byte:for",  # not key=value
        "503:for=-1",
        "503:for=nan",
    ],
)
def test_bad_specs_are_refused_with_a_reason(spec: str) -> None:
    with pytest.raises(FaultError) as exc:
        parse_fault(spec)
    assert str(exc.value)


def test_every_kind_parses_with_its_minimal_spec() -> None:
    for kind in KINDS:
        assert parse_fault("slow:factor=2" if kind == "slow" else kind).kind == kind


def test_json_form_spec_or_members() -> None:
    assert fault_from_json({"fault": "429:retry-after=2:for=10"}) == Fault(
        "429", retry_after=2.0, for_s=10.0
    )
    assert fault_from_json({"fault": "429", "retry_after": 2, "for": 10}) == Fault(
        "429", retry_after=2.0, for_s=10.0
    )
    # members override the spec's options
    assert fault_from_json({"fault": "slow:factor=2", "factor": 5}) == Fault("slow", factor=5.0)
    assert fault_from_json({"fault": "503", "retry_after": None}).retry_after is None
    assert fault_from_json({"fault": "hang-mid-stream", "after": 3, "count": 1}) == Fault(
        "hang-mid-stream", after=3.0, count=1
    )
    bads: list[object] = [{}, {"fault": 3}, [], {"fault": "429", "factor": 2},
                          {"fault": "429", "count": 0}]
    for bad in bads:
        with pytest.raises(FaultError):
            fault_from_json(bad)


def test_for_at_and_count_switch_a_fault_off_by_themselves() -> None:
    clock = Clock()
    sw = FaultSwitch(clock)
    sw.set(parse_fault("429:retry-after=2:for=10:at=5"))
    assert sw.take_status() is None  # not started yet
    assert sw.next_change() == 105.0
    clock.t = 105.0
    f = sw.take_status()
    assert f is not None and f.kind == "429" and f.retry_after == 2.0
    assert sw.next_change() == 115.0
    clock.t = 114.9
    assert sw.take_status() is not None
    clock.t = 115.0
    assert sw.take_status() is None and not sw.armed  # expired, and forgotten
    assert sw.hits["429"] == 2

    sw.set(parse_fault("hang-first-byte:count=2"))
    assert [sw.take_hang() for _ in range(3)] == [True, True, False]
    sw.set(parse_fault("hang-mid-stream:after=3:count=1"))
    assert sw.take_mid_stream() == 3 and sw.take_mid_stream() is None
    assert sw.take_status() is None


def test_429_and_503_share_a_slot_and_clear_works_by_kind_or_all() -> None:
    sw = FaultSwitch(Clock())
    sw.set(parse_fault("429"))
    sw.set(parse_fault("503:retry-after=3"))
    f = sw.take_status()
    assert f is not None and f.kind == "503" and f.retry_after == 3.0
    sw.set(parse_fault("slow:factor=4"))
    sw.set(parse_fault("hang-first-byte"))
    assert sw.slow_factor() == 4.0
    assert {d["kind"] for d in sw.describe()} == {"503", "slow", "hang-first-byte"}
    assert sw.clear("429") == 1  # the status slot
    assert sw.take_status() is None and sw.take_hang()
    assert sw.clear() == 2
    assert sw.slow_factor() == 1.0 and not sw.take_hang() and not sw.armed


def test_slow_factor_follows_the_clock_and_describe_reports_times() -> None:
    clock = Clock()
    sw = FaultSwitch(clock)
    sw.set(parse_fault("slow:factor=3:at=1:for=2"))
    assert sw.slow_factor() == 1.0
    (d,) = sw.describe()
    assert d["active"] is False and d["starts_in_s"] == 1.0 and d["ends_in_s"] == 3.0
    clock.t += 1.5
    assert sw.slow_factor() == 3.0
    clock.t += 1.5
    assert sw.slow_factor() == 1.0 and sw.describe() == [] and sw.next_change() is None


def test_process_faults_are_not_states() -> None:
    with pytest.raises(FaultError):
        FaultSwitch().set(parse_fault("die"))
    with pytest.raises(FaultError):
        FaultSwitch().set(parse_fault("refuse:for=1"))


def _events(*names: str) -> bytes:
    out = b""
    for n in names:
        out += (b'data: {"delta":{"role":"assistant"}}' if n == "role"
                else b'data: {"delta":{"content":"' + n.encode() + b'"}}') + b"\n\n"
    return out


def test_cut_stream_counts_content_chunks_not_the_role_chunk() -> None:
    data = _events("role", "a", "b", "c")
    assert _cut_stream(data, 5) == (data, 2, False)
    assert _cut_stream(data, 2) == (_events("role", "a", "b"), 0, True)
    assert _cut_stream(data, 3) == (data, 0, False)  # the next write stops
    assert _cut_stream(_events("d"), 0) == (b"", 0, True)
