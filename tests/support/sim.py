"""Small building blocks for the simulator tests: a toy engine profile with round numbers, a
hand-made workload, and a small scenario file (``SCENARIO``; ``FLEET`` the same on a failing
heterogeneous fleet) run to its report."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from qosgate.config import QosConfig, default_config
from qosgate.core import QosInputs
from qosgate.models.simmodel import EngineProfile
from qosgate.sim.driver import run_policy
from qosgate.sim.report import document, dumps
from qosgate.sim.results import RunResult
from qosgate.sim.scenario_file import load_scenario, override
from qosgate.sim.scenarios import prepare, run_scenario
from qosgate.sim.setup import SimSetup
from qosgate.sim.workload import Arrival, Stream, Workload
from tests.support import simmodel
from tests.support.classes import with_reserve

# the engine model's toy with no per-context cost: step = 0.01 + 0.001 * prefill tokens
# + 0.002 * decoding seqs
TOY = simmodel.toy(decode_s_per_ctx_token=0.0)

CLASSES = ("realtime", "api", "batch", "offline")


def toy(**update: float) -> EngineProfile:
    """The toy above with ``update`` applied."""
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


def crowded_api(retries: int) -> SimSetup:
    """Ten api requests at once in front of one toy replica whose api queue holds two: four are
    refused with a Retry-After, and their clients retry up to ``retries`` times."""
    # (no reserve: api takes every slot of the toy engine's small window)
    cfg = default_config(classes=with_reserve(0.0))
    classes = [c.model_copy(update={"max_queue": 2}) if c.name == "api" else c
               for c in cfg.classes]
    return SimSetup(
        cfg=cfg.model_copy(update={"classes": tuple(classes)}),
        profile=TOY,
        replicas=1,
        window=TOY.max_num_seqs,
        workload=workload([(0.0, "api", 10, 50)] * 10),
        sample_interval=0.05,
        retries=retries,
    )


def by_id(result: RunResult) -> dict[str, object]:
    return {r.rid: r for r in result.records}


SCENARIO = """
name: det
description: a small synthetic scenario for the determinism test
profile: qwen2.5-7b-instruct-h100
window: 32
policies: [fifo, qos, engine-priority]
seed: 11
duration_s: 20
arrivals: {process: gamma, rate: 14, burstiness: 0.5}
lengths:
  prompt: {dist: lognormal, mean: 600, cv: 1.2, max: 8000}
  output: {dist: lognormal, mean: 150, cv: 1.0, max: 1500}
mix:
  - {share: 2, class: realtime}
  - {share: 3, class: api}
  - {share: 3, class: batch}
  - {share: 2, class: offline}
tpot_slo_ms: {realtime: 100, api: 150, batch: 1000, offline: 1000}
"""


# a heterogeneous fleet of upstream-like replicas, one dying and coming back, one slowed
FLEET = (
    SCENARIO.replace("name: det", "name: det-fleet")
    .replace("window: 32", "window: 16\npausable: false\nprobe_interval_s: 0.5")
    .replace(
        "profile: qwen2.5-7b-instruct-h100",
        "profile: qwen2.5-7b-instruct-h100\n"
        "replicas:\n"
        "  - {count: 2}\n"
        "  - {profile: qwen2.5-7b-instruct-a100, window: 8}\n"
        "faults:\n"
        "  - {replica: r0, kind: die, at_s: 5, until_s: 12}\n"
        "  - {replica: r2, kind: slow, at_s: 8, factor: 2.5}",
    )
    .replace("rate: 14", "rate: 30")
)


def scenario_json(path: Path, seed: int | None = None) -> str:
    """The scenario file's report, as the bytes ``qosgate simulate --json`` writes."""
    s = load_scenario(path)
    if seed is not None:
        s = override(s, seed=seed)
    return dumps(document(run_scenario(prepare(s))))
