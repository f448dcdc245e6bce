"""The gateway's lock-free histogram renders exactly what prometheus_client's Histogram does."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from qosgate.server.metrics import LATENCY_BUCKETS, _Histogram


def _without_created(text: bytes) -> list[bytes]:
    return [ln for ln in text.splitlines() if b"_created" not in ln]


def test_same_exposition_as_prometheus_client() -> None:
    ref_reg = CollectorRegistry(auto_describe=False)
    ref = Histogram("qosgate_ttft_seconds", "Arrival to first token.", ["class"],
                    registry=ref_reg, buckets=LATENCY_BUCKETS)
    ours = _Histogram("qosgate_ttft_seconds", "Arrival to first token.", LATENCY_BUCKETS)

    class _Coll:
        def collect(self):  # type: ignore[no-untyped-def]
            yield ours.collect()

    our_reg = CollectorRegistry(auto_describe=False)
    our_reg.register(_Coll())
    rng = random.Random(7)
    values = [0.0, 0.005, 0.0050001, 600.0, 601.0, *(rng.expovariate(2.0) for _ in range(500))]
    for i, v in enumerate(values):
        cls = ("realtime", "api", "batch")[i % 3]
        ref.labels(cls).observe(v)
        ours.observe(cls, v)
    ref_text = generate_latest(ref_reg)
    our_text = generate_latest(our_reg)
    assert sorted(_without_created(our_text)) == sorted(_without_created(ref_text))
    assert our_text.count(b"qosgate_ttft_seconds_created{") == 3
