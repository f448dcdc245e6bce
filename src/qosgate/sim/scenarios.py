"""Scenarios prepared and run: a scenario file (``scenario_file.py``) resolved against its engine
profiles, qosgate config and trace (``prepare``: the capacity its load is relative to, each
replica's window), then simulated under every policy -- and, for a sweep, every load, every
gateway count, and every router of ``routers`` -- on the same requests (``run_scenario``), each
run with its metrics.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qosgate.config import QosConfig, config_from_mapping
from qosgate.core import Classifier, QosInputError
from qosgate.models.simmodel import EngineProfile, load_profile
from qosgate.sim.batches import BatchPlan, plan_batches
from qosgate.sim.batches_metrics import batch_stats, fluid_finish
from qosgate.sim.capacity import saturation_throughput
from qosgate.sim.driver import run_policy
from qosgate.sim.engine_time import engine_fairness
from qosgate.sim.metrics import Slo, analyze, gateway_stats, limit_overshoot, retry_stats
from qosgate.sim.prefix_stats import prefix_metrics, workload_ideals
from qosgate.sim.results import RunResult
from qosgate.sim.retry_after import retry_after_stats
from qosgate.sim.scenario_file import ReplicaGroup, Scenario, ScenarioError
from qosgate.sim.setup import (
    FaultPlan,
    ReplicaPlan,
    SimSetup,
)
from qosgate.sim.workload import (
    TRACE_NAME,
    TraceRow,
    Workload,
    build_workload,
    find_trace,
    read_trace,
    sample_lengths,
    stream_inputs,
    trace_attribution,
)


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
    # the config of each router compared (``Scenario.routers``), in order; empty: ``cfg`` alone
    router_cfgs: dict[str, QosConfig] = field(default_factory=dict)
    # batch jobs beside the workload (``jobs.py``), and each one's rate alone on the fleet
    # (lines/s: the replicas' saturated throughput for its line lengths)
    jobs: tuple[BatchPlan, ...] = ()
    job_idle_rates: tuple[float, ...] = ()
    # each model's engine profile (``Scenario.model_profiles``), resolved
    model_profiles: dict[str, EngineProfile] = field(default_factory=dict)

    @property
    def models(self) -> bool:
        """Whether the scenario runs several models (its streams name them, or it gives them
        profiles of their own)."""
        return bool(self.model_profiles) or any(st.model for st in self.scenario.mix)

    def configs(self) -> dict[str, QosConfig]:
        """Each router run, by name: the scenario's routers, or the config's own router."""
        return self.router_cfgs or {self.cfg.fleet.router: self.cfg}

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
    router_cfgs: dict[str, QosConfig] = {}
    for name in s.routers:  # each validated as the config would be with it
        fleet = {**dict(s.config.get("fleet", {})), "router": name}
        try:
            router_cfgs[name] = config_from_mapping({**dict(s.config), "fleet": fleet})
        except ValueError as exc:
            raise ScenarioError(f"scenario {s.name}: router {name!r}: {exc}") from None
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
    try:
        model_profiles = {m: _profile(mp.profile, mp.profile_overrides)
                          for m, mp in s.model_profiles.items()}
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
        served = {m: p for m, p in model_profiles.items() if not g.models or m in g.models}
        for _ in range(g.count):
            plans.append(ReplicaPlan(f"r{len(plans)}", prof, window, pausable, mode, g.models,
                                     tuple(served.items())))
    names = {p.name for p in plans}
    faults = []
    for f in s.faults:
        if f.name() not in names:
            raise ScenarioError(
                f"scenario {s.name}: a fault on replica {f.name()}, but the fleet has "
                f"{', '.join(p.name for p in plans)}"
            )
        faults.append(FaultPlan(f.name(), f.kind, f.at_s, f.until_s, f.factor or 1.0))
    try:
        jobs = plan_batches(s.jobs, s.lengths, trace, api_keys, s.seed, s.max_tokens,
                         s.batches.default_class)
        classifier = Classifier(cfg)
        for jp in jobs:
            classifier.classify(jp.inputs)
    except QosInputError as exc:
        raise ScenarioError(f"scenario {s.name}: a job: {exc.message}") from None
    except ValueError as exc:
        raise ScenarioError(f"scenario {s.name}: {exc}") from None
    first = plans[0]
    prep = Prepared(
        s, cfg, first.profile, first.window, mean_tokens, slos, api_keys, path, trace,
        fleet=tuple(plans), faults=tuple(faults), router_cfgs=router_cfgs, jobs=jobs,
        job_idle_rates=tuple(_idle_rate(plans, jp, s.max_tokens) for jp in jobs),
        model_profiles=model_profiles,
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


def _idle_rate(plans: list[ReplicaPlan], job: BatchPlan, max_tokens: int) -> float:
    """Lines/s the fleet completes for ``job``'s lines with nothing else running: each replica's
    saturated throughput (its window always full of the job's lines), summed."""
    biggest = max(p.window for p in plans)
    sample = job.lines[: max(4000, 4 * biggest)]
    each: dict[tuple[EngineProfile, int], float] = {}
    total = 0.0
    for p in plans:
        key = (p.profile, p.window)
        if key not in each:
            each[key] = saturation_throughput(p.profile, p.window, sample, max_tokens)
        total += each[key]
    return total


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


def setup_for(
    prep: Prepared, workload: Workload, gateways: int = 1, cfg: QosConfig | None = None,
    jobs: bool = False,
) -> SimSetup:
    """``cfg``: one router's config (``Prepared.configs``); None: the scenario's. ``jobs``: the
    scenario's batch jobs run beside the workload."""
    s = prep.scenario
    return SimSetup(
        cfg=prep.cfg if cfg is None else cfg,
        profile=prep.profile,
        replicas=len(prep.fleet),
        window=prep.window,
        workload=workload,
        sample_interval=max(workload.duration / s.sample_points, 1e-3),
        engine_queue=s.engine_queue,
        engine_preempts=s.engine_preempts,
        fleet=prep.fleet,
        faults=prep.faults,
        probe_interval=s.probe_interval_s,
        gateways=s.gateways.plan(gateways),
        retries=s.retries,
        jobs=prep.jobs if jobs else (),
        batches=s.batches,
        seed=s.seed,
        model_profiles=tuple(prep.model_profiles.items()),
        warmup=s.warmup_s,
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
    router: str = "least-load"  # the fleet router of its gateways
    routers: int = 1  # routers the scenario compares (more than one: each run is labelled)
    # with batch jobs in the scenario: whether they ran beside the workload in this run (each
    # policy runs without and with them); None: the scenario has none
    jobs: bool | None = None


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
        ideals: dict[str, Any] | None = None  # the workload's prefix ideals, once per load
        configs = prep.configs()
        # with jobs, each policy runs without them, then with them: the live figures compare
        with_jobs = (False, True) if prep.jobs else (False,)
        for count, (router, rcfg), policy, jobs in itertools.product(
            s.gateways.counts, configs.items(), s.policies, with_jobs
        ):
            setup = setup_for(prep, wl, count, rcfg, jobs)
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
            if prep.models:
                metrics["engine_time"] = engine_fairness(result, lambda t: weight.get(t, 1.0))
            if s.retries:
                metrics["retries"] = retry_stats(result, prep.slos)
                metrics["retry_after"] = retry_after_stats(result)
            if result.prefix_cache:
                if ideals is None:
                    kv = sum(
                        p.profile.kv_capacity_tokens + p.profile.host_kv_tokens
                        for p in prep.fleet
                    )
                    ideals = workload_ideals(wl.arrivals, kv)
                metrics["prefix_cache"] = prefix_metrics(result.prefix_cache, ideals)
            if result.jobs:
                metrics["jobs"] = _batch_metrics(prep, wl, result)
            run = Run(policy, the_load, offered, result, metrics, count, router, len(configs),
                      jobs if prep.jobs else None)
            out.runs.append(run)
            if on_run is not None:
                on_run(run)
    return out


def _batch_metrics(prep: Prepared, wl: Workload, result: RunResult) -> dict[str, Any]:
    """Each job's figures (``batches_metrics.batch_stats``), by name."""
    times = [a.t for a in wl.arrivals]
    out: dict[str, Any] = {}
    for job, rate in zip(result.jobs, prep.job_idle_rates, strict=True):
        spare = fluid_finish(job.lines, rate, job.at, times, prep.capacity_rps)
        out[job.name] = batch_stats(job, rate, spare)
    return out


def attribution(prep: Prepared) -> str | None:
    """Who to credit for the request data: the trace the run actually read, if any."""
    if prep.trace is None or prep.trace_path is None:
        return None
    return trace_attribution(prep.trace_path)
