"""Scenarios: a workload, an engine, a qosgate config, SLOs and the policies to compare, as YAML.

Built-in scenarios live in ``qosgate/sim/scenarios/*.yaml`` (load them by name; copy one to make
your own and load it by path). ``run_scenario`` simulates every policy (and, for a sweep, every
load) on the same requests and returns the runs with their metrics.

Load. ``arrivals.load`` is relative to the *capacity*: the saturated throughput (requests/s) of
the scenario's replicas for its length mix, measured by keeping ``window`` requests always in
flight on the same engine model (``capacity.saturation_throughput``). Load 1.0 offers exactly that
many requests per second; 2.0 twice as many. ``arrivals.rate`` gives requests/s directly.

Window. ``window: auto`` sets each replica's window to what the engine can actually run at once:
``min(max_num_seqs, kv_capacity_tokens // mean(prompt + output))`` for the scenario's length mix.
So the engine's own waiting queue stays short (it only holds what waits for prefill budget) and
the backlog is held, and ordered, in qosgate. With ``window = max_num_seqs`` on a KV-bound mix the
surplus waits in the engine's queue, ordered there by class level alone (shares between classes,
tenant fairness and deadlines no longer apply to it). ``window_mode: adaptive`` (or
``--window-mode adaptive``) gives each replica the core's adaptive window (``EngineLimit``, fed by
the engines' load signals at every health probe) with ``window`` as its ceiling; ``fixed`` keeps
``window``. Unset, the core decides: fixed for a pausable replica (the gateway's in-process
engine), ``fleet.window.mode`` for one not pausable. ``engine-priority`` passes everything through
whatever the mode.

Fleet. ``replicas: N`` gives N replicas of ``profile`` (as before); a list gives a heterogeneous
fleet, group by group (``{count, profile, profile_overrides, window, pausable, window_mode}``,
each defaulting to the scenario's own field; a group naming its own profile has no overrides
unless it gives some), named r0, r1, ... in order. The capacity is then the sum of each
replica's own. ``pausable: false`` models upstream servers (vLLM over HTTP), which the core can
only pull a request back from by abort, before its first token.

Faults. ``faults`` act on named replicas during the run: ``{replica: r0, kind: die, at_s: 40,
until_s: 80}`` kills r0's engine at 40 s (everything in it is lost) and restarts it, empty, at
80 s; ``{replica: r1, kind: slow, at_s: 60, factor: 3}`` makes each of r1's engine steps 3x as
long from 60 s on (until ``until_s`` if given). The core learns of them as the gateway would:
failed calls and health probes every ``probe_interval_s`` (see ``driver``).

Gateways. ``gateways: {counts: [1, 2, 4], spread: skewed, reach: {acme: [0]}, shared: true,
sync_interval_s: 0.05, sync_delay_s: 0}`` runs every policy with 1, 2 and 4 gateway instances
in front of the one fleet (each its own ``Scheduler``: queue, replica objects, windows; all read
the same engine signals), arrivals spread over them (``setup.GatewayPlan``), tenant state shared
through the shared-state protocol (``core.shared.SyncProtocol``) over a ``MemoryStore`` in virtual
time (``shared: false``: each instance its own limits and fair-share counters). Unset: one
gateway, as before.

Description. ``{load}``, ``{time_scale}`` and ``{duration}`` in a description are replaced by the
values the run uses (``--load``, ``--time-scale``, ``--duration`` included); an override of a
value the description does not template is noted after it.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from qosgate.config import QosConfig, config_from_mapping, read_yaml_mapping, validated
from qosgate.core import Classifier, QosInputError
from qosgate.models.simmodel import EngineProfile, load_profile
from qosgate.sim.capacity import saturation_throughput
from qosgate.sim.driver import run_policy
from qosgate.sim.metrics import Slo, analyze, gateway_stats, limit_overshoot, retry_stats
from qosgate.sim.results import RunResult
from qosgate.sim.setup import (
    SIM_POLICIES,
    EngineQueue,
    FaultPlan,
    GatewayPlan,
    ReplicaPlan,
    SimSetup,
)
from qosgate.sim.workload import (
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
    stream_inputs,
    trace_attribution,
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


Window = Annotated[int, Field(ge=1)] | Literal["auto"]
WindowMode = Literal["fixed", "adaptive"]


class ReplicaGroup(_Model):
    """``count`` replicas of one kind in a heterogeneous fleet; unset fields take the
    scenario's (``profile``, ``window``, ``pausable``; ``profile_overrides`` only for a group
    that names no profile of its own: the scenario's overrides go with the scenario's profile)."""

    count: int = Field(default=1, ge=1)
    profile: str | None = None
    profile_overrides: dict[str, float] | None = None
    window: Window | None = None
    pausable: bool | None = None
    window_mode: WindowMode | None = None


class Fault(_Model):
    """What happens to one replica during the run (see the module doc)."""

    replica: str | Annotated[int, Field(ge=0)] = Field(description="r0, r1, ... or an index")
    kind: Literal["die", "slow"]
    at_s: float = Field(ge=0, description="virtual seconds from the start")
    until_s: float | None = Field(
        default=None, description="die: restarted (empty) then; slow: normal speed again"
    )
    factor: float | None = Field(default=None, gt=0, description="slow: step time x factor")

    @model_validator(mode="after")
    def _ok(self) -> Fault:
        if self.kind == "slow" and self.factor is None:
            raise ValueError("a slow fault needs a factor (step time x factor)")
        if self.kind == "die" and self.factor is not None:
            raise ValueError("a die fault takes no factor")
        if self.until_s is not None and self.until_s <= self.at_s:
            raise ValueError("until_s must be after at_s")
        return self

    def name(self) -> str:
        return f"r{self.replica}" if isinstance(self.replica, int) else self.replica


class Gateways(_Model):
    """Gateway instances in front of the one fleet (see the module doc and ``GatewayPlan``)."""

    counts: tuple[Annotated[int, Field(ge=1, le=64)], ...] = Field(default=(1,), min_length=1)
    spread: Literal["round-robin", "hash", "skewed"] = "round-robin"
    # skewed: tenant -> the gateway indices (mod the count) its requests reach
    reach: dict[str, tuple[Annotated[int, Field(ge=0)], ...]] = Field(default_factory=dict)
    shared: bool = True
    sync_interval_s: float = Field(default=0.05, gt=0)
    sync_delay_s: float = Field(default=0.0, ge=0)

    def plan(self, count: int) -> GatewayPlan:
        return GatewayPlan(
            count, self.spread, tuple((t, tuple(ix)) for t, ix in sorted(self.reach.items())),
            self.shared, self.sync_interval_s, self.sync_delay_s,
        )


class Scenario(_Model):
    name: str
    description: str = ""
    profile: str = "qwen2.5-7b-instruct-h100"
    profile_overrides: dict[str, float] = Field(default_factory=dict)
    replicas: Annotated[int, Field(ge=1)] | tuple[ReplicaGroup, ...] = 1
    window: Window = "auto"
    pausable: bool = True
    # the core's window per replica: "adaptive" (``window`` is then its ceiling) or "fixed";
    # unset: the core's default, fixed for a pausable replica, ``fleet.window.mode`` otherwise
    window_mode: WindowMode | None = None
    engine_queue: EngineQueue = "auto"
    policies: tuple[str, ...] = Field(default=("fifo", "priority", "qos"), min_length=1)
    faults: tuple[Fault, ...] = ()
    probe_interval_s: float = Field(
        default=1.0, gt=0, description="health probe (and metrics scrape) cadence, as the gateway's"
    )
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
    gateways: Gateways = Gateways()
    retries: int = Field(
        default=0, ge=0, le=20, description="clients honour a refusal's Retry-After: each "
        "refused request is sent again that much later, up to this many times (0: a refusal "
        "is final)")

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
        if isinstance(self.replicas, tuple) and not self.replicas:
            raise ValueError("replicas: an empty list (give a count or at least one group)")
        spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
        for f in self.faults:
            spans.setdefault((f.name(), f.kind), []).append(
                (f.at_s, math.inf if f.until_s is None else f.until_s)
            )
        for (rep, kind), xs in spans.items():
            xs.sort()
            if any(b[0] < a[1] for a, b in itertools.pairwise(xs)):
                raise ValueError(f"faults: overlapping {kind} faults on replica {rep}")
        for t, ix in self.gateways.reach.items():
            if not ix:
                raise ValueError(f"gateways.reach: tenant {t!r} reaches no gateway")
        return self

    def replica_count(self) -> int:
        if isinstance(self.replicas, int):
            return self.replicas
        return sum(g.count for g in self.replicas)

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


# what a description may template, and what overriding each changes
_PLACEHOLDERS = {
    "load": ("load", "sweep"),
    "time_scale": ("time_scale",),
    "duration": ("duration_s",),
}
_PLACEHOLDER_RE = re.compile(r"\{(load|time_scale|duration)\}")


def _loads_text(s: Scenario) -> str:
    if s.sweep is not None:
        lo, hi = min(s.sweep.loads), max(s.sweep.loads)
        return f"{100 * lo:g}-{100 * hi:g}%" if lo != hi else f"{100 * lo:g}%"
    if s.arrivals.load is not None:
        return f"{s.arrivals.load:g}x"
    if s.arrivals.rate is not None:
        return f"{s.arrivals.rate:g} req/s"
    return "as recorded"


def _values(s: Scenario) -> dict[str, str]:
    return {
        "load": _loads_text(s),
        "time_scale": f"{s.arrivals.time_scale:g}x",
        "duration": "the whole trace" if s.duration_s is None else f"{s.duration_s:g} s",
    }


def describe(s: Scenario) -> str:
    """The scenario's description with ``{load}``, ``{time_scale}`` and ``{duration}`` filled in
    with what the run uses."""
    vals = _values(s)
    return _PLACEHOLDER_RE.sub(lambda m: vals[m.group(1)], s.description)


def override(scenario: Scenario, **changes: Any) -> Scenario:
    """A copy with top-level fields replaced (``arrivals={...}`` merges into the arrivals),
    re-validated. A description that does not template a value the override changes gets a
    note saying what the run uses instead."""
    data = scenario.model_dump(by_alias=True)
    where = f"scenario {scenario.name} (with overrides)"
    if isinstance(scenario.replicas, tuple):
        for k in ("replicas", "profile"):
            if k in changes:
                raise ScenarioError(
                    f"{where}: {k} cannot be overridden: the scenario lists its replicas "
                    "one group at a time (edit its replicas list)"
                )
    touched: set[str] = set()
    for k, v in changes.items():
        if k == "arrivals":
            data["arrivals"] = {**data["arrivals"], **v}
            touched |= set(v)
        else:
            data[k] = v
            touched.add(k)
    new = scenario_from_mapping(data, f"{scenario.name} (with overrides)")
    before, after = _values(scenario), _values(new)
    notes = [
        f"{key.replace('_', ' ')} {after[key]}"
        for key, fields in _PLACEHOLDERS.items()
        if touched & set(fields)
        and before[key] != after[key]
        and "{" + key + "}" not in scenario.description
    ]
    if notes:
        desc = new.description + f" [overridden: {', '.join(notes)}]"
        new = new.model_copy(update={"description": desc})
    return new


# ------------------------------------------------------------------------------ preparation
@dataclass(slots=True)
class Prepared:
    """A scenario resolved against its engine profiles, config and trace. ``profile`` and
    ``window`` are the first replica's (the only kind in a uniform fleet); ``fleet`` lists every
    replica."""

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
    fleet: tuple[ReplicaPlan, ...] = ()
    faults: tuple[FaultPlan, ...] = ()

    @property
    def uniform(self) -> bool:
        """Every replica has the same profile and window."""
        return len({(p.profile, p.window, p.pausable) for p in self.fleet}) <= 1

    def fleet_text(self) -> str:
        """``qwen2.5-7b-instruct-h100 x2 (window 748) + qwen2.5-7b-instruct-a100 x1 (...)``"""
        groups: dict[tuple[str, int, bool], int] = {}
        for p in self.fleet:
            key = (p.profile.name, p.window, p.pausable)
            groups[key] = groups.get(key, 0) + 1
        return " + ".join(
            f"{name} x{n} (window {w}{'' if pausable else ', not pausable'})"
            for (name, w, pausable), n in groups.items()
        )


def _profile(name: str, overrides: dict[str, float]) -> EngineProfile:
    prof = load_profile(name)
    if overrides:
        data = prof.model_dump()
        for k, v in overrides.items():
            if k not in data or k in ("name", "model", "gpu"):
                raise ScenarioError(f"profile_overrides: unknown field {k!r}")
            data[k] = int(v) if isinstance(data[k], int) else float(v)
        prof = EngineProfile.model_validate(data)
    return prof


def _groups(s: Scenario) -> list[ReplicaGroup]:
    if isinstance(s.replicas, int):
        return [ReplicaGroup(count=s.replicas)]
    return list(s.replicas)


def _check_mix(s: Scenario, cfg: QosConfig, api_keys: dict[str, str]) -> None:
    """Every stream's QoS inputs classify under the config (a class typo, an unknown tenant or
    task type is an error now, not a traceback mid-run)."""
    classifier = Classifier(cfg)
    for k, st in enumerate(s.mix):
        try:
            classifier.classify(stream_inputs(st, api_keys))
        except QosInputError as exc:
            raise ScenarioError(
                f"scenario {s.name}: mix[{k}] ({st.label()}): {exc.message}"
            ) from None
        except ValueError as exc:
            raise ScenarioError(f"scenario {s.name}: mix[{k}]: {exc}") from None


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
    groups = _groups(s)
    profiles: list[EngineProfile] = []
    try:
        for g in groups:
            name = g.profile if g.profile is not None else s.profile
            # the scenario's overrides go with the scenario's profile
            over = g.profile_overrides
            if over is None:
                over = s.profile_overrides if g.profile is None else {}
            profiles.append(_profile(name, over))
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
    _check_mix(s, cfg, api_keys)
    unknown_t = sorted(set(s.gateways.reach) - {t.name for t in cfg.tenants})
    if unknown_t:
        raise ScenarioError(f"scenario {s.name}: gateways.reach names unknown tenants {unknown_t}")
    trace = None
    path: Path | None = None
    if trace_path is not None and not s.needs_trace():
        raise ScenarioError(
            f"scenario {s.name} draws nothing from a trace: --trace {trace_path} would go unused"
        )
    if s.needs_trace():
        try:
            path = find_trace(str(trace_path or s.trace or TRACE_NAME))
            trace = read_trace(path)
        except (OSError, ValueError) as exc:
            raise ScenarioError(str(exc)) from None
    sample = sample_lengths(s.mix, s.lengths, trace, s.seed, 4000)
    mean_tokens = math.fsum(p + o for p, o in sample) / len(sample)
    plans: list[ReplicaPlan] = []
    for g, prof in zip(groups, profiles, strict=True):
        setting = g.window if g.window is not None else s.window
        if setting == "auto":
            window = max(1, min(prof.max_num_seqs, int(prof.kv_capacity_tokens // mean_tokens)))
        else:
            window = setting
        pausable = g.pausable if g.pausable is not None else s.pausable
        mode = g.window_mode if g.window_mode is not None else s.window_mode
        for _ in range(g.count):
            plans.append(ReplicaPlan(f"r{len(plans)}", prof, window, pausable, mode))
    names = {p.name for p in plans}
    faults = []
    for f in s.faults:
        if f.name() not in names:
            raise ScenarioError(
                f"scenario {s.name}: a fault on replica {f.name()}, but the fleet has "
                f"{', '.join(p.name for p in plans)}"
            )
        faults.append(FaultPlan(f.name(), f.kind, f.at_s, f.until_s, f.factor or 1.0))
    first = plans[0]
    prep = Prepared(
        s, cfg, first.profile, first.window, mean_tokens, slos, api_keys, path, trace,
        fleet=tuple(plans), faults=tuple(faults),
    )
    need = s.arrivals.load is not None or s.sweep is not None
    if measure_capacity is None:
        measure_capacity = need or s.arrivals.process == "trace"
    if s.capacity_rps is not None:
        prep.capacity_rps = s.capacity_rps
    elif measure_capacity:
        biggest = max(p.window for p in plans)
        n = max(4000, 4 * biggest)
        more = sample if n <= len(sample) else sample_lengths(s.mix, s.lengths, trace, s.seed, n)
        each: dict[tuple[EngineProfile, int], float] = {}
        total = 0.0
        for p in plans:  # the fleet's capacity: the sum of each replica's own
            key = (p.profile, p.window)
            if key not in each:
                each[key] = saturation_throughput(p.profile, p.window, more, s.max_tokens)
            total += each[key]
        prep.capacity_rps = total
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


def setup_for(prep: Prepared, workload: Workload, gateways: int = 1) -> SimSetup:
    s = prep.scenario
    return SimSetup(
        cfg=prep.cfg,
        profile=prep.profile,
        replicas=len(prep.fleet),
        window=prep.window,
        workload=workload,
        sample_interval=max(workload.duration / s.sample_points, 1e-3),
        engine_queue=s.engine_queue,
        fleet=prep.fleet,
        faults=prep.faults,
        probe_interval=s.probe_interval_s,
        gateways=s.gateways.plan(gateways),
        retries=s.retries,
    )


# ------------------------------------------------------------------------------ running
@dataclass(slots=True)
class Run:
    policy: str
    load: float | None  # offered load (x capacity) when known
    offered_rps: float
    result: RunResult
    metrics: dict[str, Any]
    gateways: int = 1  # gateway instances in front of the fleet


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
    limits = {t.name: t.limits for t in cfg.tenants}
    for load in loads:
        wl = workload_for(prep, load)
        offered = wl.offered_rps
        the_load = load
        if the_load is None and prep.capacity_rps:
            the_load = offered / prep.capacity_rps
        for count, policy in itertools.product(s.gateways.counts, s.policies):
            setup = setup_for(prep, wl, count)
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
            metrics["gateways"] = gateway_stats(
                result, prep.slos, cfg.fairness.prompt_weight, cfg.fairness.output_weight,
                lambda t: weight.get(t, 1.0), s.warmup_s,
            )
            metrics["limits"] = limit_overshoot(result, limits)
            if s.retries:
                metrics["retries"] = retry_stats(result, prep.slos)
            run = Run(policy, the_load, offered, result, metrics, count)
            out.runs.append(run)
            if on_run is not None:
                on_run(run)
    return out


def attribution(prep: Prepared) -> str | None:
    """Who to credit for the request data: the trace the run actually read, if any."""
    if prep.trace is None or prep.trace_path is None:
        return None
    return trace_attribution(prep.trace_path)
