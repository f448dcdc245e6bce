"""Small building blocks for the simulator tests: a toy engine profile with round numbers and a
hand-made workload."""

from __future__ import annotations

from collections.abc import Sequence

from qosgate.config import QosConfig, default_config
from qosgate.core import QosInputs
from qosgate.models.simmodel import EngineProfile
from qosgate.sim.driver import run_policy
from qosgate.sim.results import RunResult
from qosgate.sim.setup import SimSetup
from qosgate.sim.workload import Arrival, Stream, Workload

# step = 0.01 + 0.001 * prefill tokens + 0.002 * decoding seqs (no per-context cost)
TOY = EngineProfile(
    name="toy",
    model="toy",
    gpu="none",
    step_fixed_s=0.01,
    prefill_s_per_token=0.001,
    decode_s_per_ctx_token=0.0,
    decode_s_per_seq=0.002,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    kv_capacity_tokens=10_000,
)

CLASSES = ("realtime", "api", "batch", "offline")


def toy(**update: float) -> EngineProfile:
    return TOY.model_copy(update=update)


def workload(
    reqs: Sequence[tuple[float, str, int, int]], duration: float | None = None
) -> Workload:
    """``reqs``: (arrival time, class, prompt tokens, output tokens), one stream per class."""
    streams = tuple(Stream.model_validate({"share": 1, "class": c}) for c in CLASSES)
    inputs = tuple(QosInputs(qos_class=c) for c in CLASSES)
    arrivals = tuple(
        Arrival(t, f"r{i:06d}", CLASSES.index(cls), p, o, max(o, 64))
        for i, (t, cls, p, o) in enumerate(sorted(reqs, key=lambda r: r[0]))
    )
    end = duration if duration is not None else (arrivals[-1].t + 1e-9 if arrivals else 1.0)
    return Workload(arrivals, streams, inputs, end, len(arrivals) / end)


def simulate(
    reqs: Sequence[tuple[float, str, int, int]],
    policy: str = "qos",
    profile: EngineProfile = TOY,
    window: int | None = None,
    replicas: int = 1,
    cfg: QosConfig | None = None,
    duration: float | None = None,
) -> RunResult:
    setup = SimSetup(
        cfg=cfg or default_config(),
        profile=profile,
        replicas=replicas,
        window=window or profile.max_num_seqs,
        workload=workload(reqs, duration),
        sample_interval=0.05,
    )
    return run_policy(setup, policy)


def by_id(result: RunResult) -> dict[str, object]:
    return {r.rid: r for r in result.records}
