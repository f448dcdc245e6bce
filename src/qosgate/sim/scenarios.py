"""Scenarios: a workload, an engine, a qosgate config, SLOs and the policies to compare, as YAML.

Built-in scenarios live in ``qosgate/sim/scenarios/*.yaml`` (load them by name; copy one to make
your own and load it by path). ``run_scenario`` simulates every policy (and, for a sweep, every
load) on the same requests and returns the runs with their metrics.

Load. ``arrivals.load`` is relative to the *capacity*: the saturated throughput (requests/s) of
the scenario's replicas for its length mix, measured by keeping ``window`` requests always in
flight on the same engine model (``driver.saturation_throughput``). Load 1.0 offers exactly that
many requests per second; 2.0 twice as many. ``arrivals.rate`` gives requests/s directly.

Window. ``window: auto`` sets each replica's window to what the engine can actually run at once:
``min(max_num_seqs, kv_capacity_tokens // mean(prompt + output))`` for the scenario's length mix.
So the engine's own waiting queue stays short (it only holds what waits for prefill budget) and
the backlog is held, and ordered, in qosgate. With ``window = max_num_seqs`` on a KV-bound mix the
surplus waits in the engine's queue, ordered there by class level alone (shares between classes,
tenant fairness and deadlines no longer apply to it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from qosgate.config import QosConfig, config_from_mapping, read_yaml_mapping, validated
from qosgate.engines.simmodel import EngineProfile, load_profile
from qosgate.sim.driver import (
    SIM_POLICIES,
    EngineQueue,
    RunResult,
    SimSetup,
    run_policy,
    saturation_throughput,
)
from qosgate.sim.metrics import Slo, analyze
from qosgate.sim.workload import (
    TRACE_ATTRIBUTION,
    TRACE_NAME,
    FromTrace,
    Lengths,
    Stream,
    TraceRow,
    Workload,
    build_workload,
    find_trace,
    read_trace,
    sample_lengths,
)

SCENARIO_DIR = Path(__file__).parent / "scenarios"


class ScenarioError(ValueError):
    pass


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Arrivals(_Model):
    process: Literal["poisson", "gamma", "trace"] = "poisson"
    rate: float | None = Field(default=None, gt=0, description="requests per second")
    load: float | None = Field(default=None, gt=0, description="x the measured capacity")
    burstiness: float = Field(default=1.0, gt=0, description="gamma shape: 1 Poisson, <1 bursty")
    time_scale: float = Field(default=1.0, gt=0, description="trace: replay this many x faster")

    @model_validator(mode="after")
    def _one_rate(self) -> Arrivals:
        if self.rate is not None and self.load is not None:
            raise ValueError("give arrivals.rate or arrivals.load, not both")
        return self


class Sweep(_Model):
    loads: tuple[float, ...] = Field(min_length=1)


class Scenario(_Model):
    name: str
    description: str = ""
    profile: str = "qwen2.5-7b-instruct-h100"
    profile_overrides: dict[str, float] = Field(default_factory=dict)
    replicas: int = Field(default=1, ge=1)
    window: int | Literal["auto"] = "auto"
    engine_queue: EngineQueue = "auto"
    policies: tuple[str, ...] = ("fifo", "priority", "qos")
    seed: int = 1
    duration_s: float | None = Field(default=120.0, gt=0)
    arrivals: Arrivals = Arrivals(load=1.0)
    trace: str | None = Field(default=None, description="trace file name or path")
    lengths: Lengths = Lengths()
    max_tokens: int = Field(default=2048, ge=1, description="the clients' max_tokens (>= output)")
    mix: tuple[Stream, ...] = Field(min_length=1)
    config: dict[str, Any] = Field(default_factory=dict)
    ttft_slo_ms: dict[str, float] = Field(default_factory=dict)
    tpot_slo_ms: dict[str, float] = Field(default_factory=dict)
    sweep: Sweep | None = None
    capacity_rps: float | None = Field(default=None, gt=0, description="skip the measurement")
    sample_points: int = Field(default=400, ge=10)
    warmup_s: float = Field(default=0.0, ge=0, description="excluded from the fairness measure")

    @model_validator(mode="after")
    def _ok(self) -> Scenario:
        for p in self.policies:
            if p not in SIM_POLICIES:
                raise ValueError(f"unknown policy {p!r}; choose from {', '.join(SIM_POLICIES)}")
        if self.arrivals.process != "trace" and self.duration_s is None:
            raise ValueError("duration_s is needed unless arrivals come from a trace")
        if (
            self.arrivals.process != "trace"
            and self.arrivals.rate is None
            and self.arrivals.load is None
            and self.sweep is None
        ):
            raise ValueError("give arrivals.rate, arrivals.load or a sweep")
        return self

    def needs_trace(self) -> bool:
        laws: list[object] = [self.lengths.prompt, self.lengths.output]
        for s in self.mix:
            laws += [s.prompt, s.output]
        return self.arrivals.process == "trace" or any(isinstance(x, FromTrace) for x in laws)


def available_scenarios() -> list[str]:
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.yaml"))


def load_scenario(name_or_path: str | Path) -> Scenario:
    """A built-in scenario by name, or a YAML file by path."""
    path = Path(name_or_path)
    if not path.is_file():
        path = SCENARIO_DIR / f"{name_or_path}.yaml"
        if not path.is_file():
            raise ScenarioError(
                f"unknown scenario {str(name_or_path)!r}: not a file, and not one of "
                f"{', '.join(available_scenarios())}"
            )
    raw = read_yaml_mapping(path, "scenario", ScenarioError)
    return scenario_from_mapping(raw, str(path))


def scenario_from_mapping(raw: dict[str, Any], where: str = "scenario") -> Scenario:
    return validated(Scenario, raw, f"scenario {where}", ScenarioError)


def override(scenario: Scenario, **changes: Any) -> Scenario:
    """A copy with top-level fields replaced (``arrivals={...}`` merges into the arrivals),
    re-validated."""
    data = scenario.model_dump(by_alias=True)
    for k, v in changes.items():
        if k == "arrivals":
            data["arrivals"] = {**data["arrivals"], **v}
        else:
            data[k] = v
    return scenario_from_mapping(data, f"{scenario.name} (with overrides)")


# ------------------------------------------------------------------------------ preparation
@dataclass(slots=True)
class Prepared:
    """A scenario resolved against its engine profile, config and trace."""

    scenario: Scenario
    cfg: QosConfig
    profile: EngineProfile
    window: int
    mean_tokens: float  # mean prompt + output of the mix
    slos: dict[str, Slo]
    api_keys: dict[str, str]
    trace_path: Path | None = None
    trace: tuple[TraceRow, ...] | None = None
    capacity_rps: float | None = None
    capacity_measured: bool = False


def _profile(s: Scenario) -> EngineProfile:
    prof = load_profile(s.profile)
    if s.profile_overrides:
        data = prof.model_dump()
        for k, v in s.profile_overrides.items():
            if k not in data or k in ("name", "model", "gpu"):
                raise ScenarioError(f"profile_overrides: unknown field {k!r}")
            data[k] = int(v) if isinstance(data[k], int) else float(v)
        prof = EngineProfile.model_validate(data)
    return prof


def prepare(
    scenario: Scenario,
    trace_path: str | Path | None = None,
    measure_capacity: bool | None = None,
) -> Prepared:
    s = scenario
    try:
        cfg = config_from_mapping(dict(s.config))
    except ValueError as exc:
        raise ScenarioError(f"scenario {s.name}: {exc}") from None
    try:
        prof = _profile(s)
    except ValueError as exc:
        raise ScenarioError(str(exc)) from None
    classes = [c.name for c in cfg.classes]
    missing = [c for c in classes if c not in s.tpot_slo_ms]
    if missing:
        raise ScenarioError(f"scenario {s.name}: tpot_slo_ms has no SLO for {missing}")
    unknown = sorted((set(s.tpot_slo_ms) | set(s.ttft_slo_ms)) - set(classes))
    if unknown:
        raise ScenarioError(f"scenario {s.name}: SLOs for unknown classes {unknown}")
    slos = {
        c.name: Slo(
            s.ttft_slo_ms.get(c.name, c.ttft_budget_ms) / 1000.0, s.tpot_slo_ms[c.name] / 1000.0
        )
        for c in cfg.classes
    }
    api_keys = {t.name: t.api_keys[0] for t in cfg.tenants if t.api_keys}
    trace = None
    path: Path | None = None
    if s.needs_trace() or trace_path is not None:
        try:
            path = find_trace(str(trace_path or s.trace or TRACE_NAME))
            trace = read_trace(path)
        except (OSError, ValueError) as exc:
            raise ScenarioError(str(exc)) from None
    sample = sample_lengths(s.mix, s.lengths, trace, s.seed, 4000)
    mean_tokens = math.fsum(p + o for p, o in sample) / len(sample)
    if s.window == "auto":
        window = max(1, min(prof.max_num_seqs, int(prof.kv_capacity_tokens // mean_tokens)))
    else:
        window = s.window
    prep = Prepared(s, cfg, prof, window, mean_tokens, slos, api_keys, path, trace)
    need = s.arrivals.load is not None or s.sweep is not None
    if measure_capacity is None:
        measure_capacity = need or s.arrivals.process == "trace"
    if s.capacity_rps is not None:
        prep.capacity_rps = s.capacity_rps
    elif measure_capacity:
        n = max(4000, 4 * window)
        more = sample if n <= len(sample) else sample_lengths(s.mix, s.lengths, trace, s.seed, n)
        cap = saturation_throughput(prof, window, more, s.max_tokens)
        prep.capacity_rps = cap * s.replicas
        prep.capacity_measured = True
    return prep


def workload_for(prep: Prepared, load: float | None = None) -> Workload:
    s = prep.scenario
    a = s.arrivals
    rate = a.rate
    the_load = load if load is not None else a.load
    if a.process != "trace" and the_load is not None:
        if prep.capacity_rps is None:
            raise ScenarioError("a load needs the capacity (measured or capacity_rps)")
        rate = the_load * prep.capacity_rps
    try:
        return build_workload(
            process=a.process,
            streams=s.mix,
            lengths=s.lengths,
            api_keys=prep.api_keys,
            seed=s.seed,
            duration=s.duration_s,
            rate=rate,
            burstiness=a.burstiness,
            trace=prep.trace,
            time_scale=a.time_scale,
            max_tokens=s.max_tokens,
        )
    except ValueError as exc:
        raise ScenarioError(f"scenario {s.name}: {exc}") from None


def setup_for(prep: Prepared, workload: Workload) -> SimSetup:
    s = prep.scenario
    return SimSetup(
        cfg=prep.cfg,
        profile=prep.profile,
        replicas=s.replicas,
        window=prep.window,
        workload=workload,
        sample_interval=max(workload.duration / s.sample_points, 1e-3),
        engine_queue=s.engine_queue,
    )


# ------------------------------------------------------------------------------ running
@dataclass(slots=True)
class Run:
    policy: str
    load: float | None  # offered load (x capacity) when known
    offered_rps: float
    result: RunResult
    metrics: dict[str, Any]


@dataclass(slots=True)
class ScenarioResult:
    prep: Prepared
    runs: list[Run] = field(default_factory=list)

    @property
    def scenario(self) -> Scenario:
        return self.prep.scenario


# progress(policy, load, done_fraction)
RunProgress = Callable[[str, float | None, float], None]


def run_scenario(
    prep: Prepared,
    progress: RunProgress | None = None,
    on_run: Callable[[Run], None] | None = None,
) -> ScenarioResult:
    s = prep.scenario
    cfg = prep.cfg
    tier = {t.name: t.tier for t in cfg.tenants}
    weight = {t.name: t.weight for t in cfg.tenants}
    names = [st.label() for st in s.mix]
    loads: list[float | None] = list(s.sweep.loads) if s.sweep else [s.arrivals.load]
    out = ScenarioResult(prep)
    for load in loads:
        wl = workload_for(prep, load)
        setup = setup_for(prep, wl)
        offered = wl.offered_rps
        the_load = load
        if the_load is None and prep.capacity_rps:
            the_load = offered / prep.capacity_rps
        for policy in s.policies:
            cb = None
            if progress is not None:
                span = wl.duration

                def cb(
                    t: float,
                    _done: int,
                    _p: str = policy,
                    _l: float | None = load,
                    _span: float = span,
                ) -> None:
                    assert progress is not None
                    progress(_p, _l, min(1.0, t / _span) if _span > 0 else 1.0)

            result = run_policy(setup, policy, cb)
            metrics = analyze(
                result,
                prep.slos,
                lambda t: tier.get(t, "-"),
                cfg.fairness.prompt_weight,
                cfg.fairness.output_weight,
                lambda t: weight.get(t, 1.0),
                names,
                s.warmup_s,
            )
            run = Run(policy, the_load, offered, result, metrics)
            out.runs.append(run)
            if on_run is not None:
                on_run(run)
    return out


def attribution(prep: Prepared) -> str | None:
    return TRACE_ATTRIBUTION if prep.trace is not None else None
