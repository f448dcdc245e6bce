"""The scenario file: a workload, an engine, a qosgate config, SLOs and the policies to compare,
as YAML, validated (``Scenario``), loaded by name or path, overridden from the command line.

Built-in scenarios live in ``qosgate/sim/scenarios/*.yaml`` (load them by name; copy one to make
your own and load it by path). ``scenarios.py`` prepares and runs them.

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
``--window-mode adaptive``) gives each replica the core's adaptive window (``AdaptiveWindow``, fed
by the engines' load signals at every health probe) with ``window`` as its ceiling; ``fixed`` keeps
``window``. Unset, the core decides: fixed for a pausable replica (the gateway's in-process
engine), ``fleet.window.mode`` for one not pausable. ``engine-priority`` passes everything through
whatever the mode.

Fleet. ``replicas: N`` gives N replicas of ``profile`` (as before); a list gives a heterogeneous
fleet, group by group (``{count, profile, profile_overrides, window, pausable, window_mode}``,
each defaulting to the scenario's own field; a group naming its own profile has no overrides
unless it gives some), named r0, r1, ... in order. The capacity is then the sum of each
replica's own. ``pausable: false`` models upstream servers (vLLM over HTTP), which the core can
only pull a request back from by abort, before its first token.

Models. A stream may ask for a ``model``; a replica group says which ``models`` it serves
(unset: any). ``model_profiles: {heavy: {profile: qwen2.5-7b-instruct-h100, profile_overrides:
{...}}}`` gives a model its own engine profile (its step time): a replica serving it runs its
seqs with that profile's times. A replica serving several models with profiles of their own runs
them on one accelerator, taking turns: each step runs every model's forward pass in sequence, so
it lasts the sum of each model's step time over its own seqs (``SimEngine``'s ``models``; the
batch, token budget and KV cache are the replica's own profile's, shared by the models). A
model with no entry runs on the replica's profile. In ``config.models`` (the models' weights),
a model's ``profile`` may name an entry of ``model_profiles`` (else a built-in profile or a
file): the weights then come from the profiles (``models.token_times``), and fair share is a
share of engine time. The capacity a ``load`` is relative to is measured on the replicas' own
profiles, whatever model they run: a scenario with ``model_profiles`` gives ``arrivals.rate``.

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

Routers. ``routers: [least-load, cache-aware]`` (or ``--router least-load,cache-aware``) runs
every policy once per fleet router (``fleet.router``), on the same requests; unset, the config's
own router alone.

Jobs. ``jobs: [{lines: 20000, at_s: 0, window_s: 3600, class: offline, tenant: acme}]`` (or
``--job 20000@0s/1h,class=offline``) feeds batch jobs into the same scheduler beside the live
workload, as the gateway's feeder does (``jobs.py``, ``batches_feed.py``), with the ``batches``
settings of the gateway's config (``queued_per_job``, ``retries``, ``backoff_s``, ...). Every
policy then runs twice, without and with the jobs, so the live classes' figures compare.

Description. ``{load}``, ``{time_scale}`` and ``{duration}`` in a description are replaced by the
values the run uses (``--load``, ``--time-scale``, ``--duration`` included); an override of a
value the description does not template is noted after it.
"""

from __future__ import annotations

import itertools
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from qosgate.config import Strict, read_yaml_mapping, validated
from qosgate.settings import BatchSettings
from qosgate.sim.batches import BatchSpec
from qosgate.sim.setup import (
    SIM_POLICIES,
    EngineQueue,
    GatewayPlan,
)
from qosgate.sim.workload import (
    FromTrace,
    Lengths,
    Stream,
)

SCENARIO_DIR = Path(__file__).parent / "scenarios"


class ScenarioError(ValueError):
    pass


class Arrivals(Strict):
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


class Sweep(Strict):
    loads: tuple[float, ...] = Field(min_length=1)


Window = Annotated[int, Field(ge=1)] | Literal["auto"]
WindowMode = Literal["fixed", "adaptive"]


class ReplicaGroup(Strict):
    """``count`` replicas of one kind in a heterogeneous fleet; unset fields take the
    scenario's (``profile``, ``window``, ``pausable``; ``profile_overrides`` only for a group
    that names no profile of its own: the scenario's overrides go with the scenario's profile)."""

    count: int = Field(default=1, ge=1)
    profile: str | None = None
    profile_overrides: dict[str, float] | None = None
    window: Window | None = None
    pausable: bool | None = None
    window_mode: WindowMode | None = None
    models: tuple[str, ...] = Field(default=(), description="the models it serves (empty: any)")


class ModelProfile(Strict):
    """One model's engine profile in a scenario (``model_profiles``, see the module doc)."""

    profile: str = "qwen2.5-7b-instruct-h100"
    profile_overrides: dict[str, float] = Field(default_factory=dict)


class Fault(Strict):
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


class Gateways(Strict):
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


class Scenario(Strict):
    name: str
    description: str = ""
    profile: str = "qwen2.5-7b-instruct-h100"
    profile_overrides: dict[str, float] = Field(default_factory=dict)
    # each model's engine profile (module doc: Models); empty: every model runs on the replica's
    model_profiles: dict[str, ModelProfile] = Field(default_factory=dict)
    replicas: Annotated[int, Field(ge=1)] | tuple[ReplicaGroup, ...] = 1
    window: Window = "auto"
    pausable: bool = True
    # the core's window per replica: "adaptive" (``window`` is then its ceiling) or "fixed";
    # unset: the core's default, fixed for a pausable replica, ``fleet.window.mode`` otherwise
    window_mode: WindowMode | None = None
    engine_queue: EngineQueue = "auto"
    # under a priority engine queue, a waiting request preempts a running one of a larger value
    # (vLLM V0, and the open fix of vLLM issue 40004); false: vLLM 0.32, which never does
    engine_preempts: bool = True
    policies: tuple[str, ...] = Field(default=("fifo", "priority", "qos"), min_length=1)
    # fleet routers to compare, one run each on the same requests (config ``fleet.router``);
    # empty: the config's own
    routers: tuple[str, ...] = ()
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
    # batch jobs fed beside the live workload (``jobs.py``), and the gateway's feed settings
    # for them (config section ``batches``: queued_per_job, retries, backoff_s, ...)
    jobs: tuple[BatchSpec, ...] = ()
    batches: BatchSettings = BatchSettings()

    @model_validator(mode="after")
    def _ok(self) -> Scenario:
        for p in self.policies:
            if p not in SIM_POLICIES:
                raise ValueError(f"unknown policy {p!r}; choose from {', '.join(SIM_POLICIES)}")
        if len(set(self.routers)) != len(self.routers):
            raise ValueError(f"routers: a router named twice in {list(self.routers)}")
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
        if self.model_profiles and (self.arrivals.load is not None or self.sweep is not None):
            raise ValueError("a scenario with model_profiles gives arrivals.rate: the capacity "
                             "a load is relative to is not measured per model")
        groups = self.replicas if isinstance(self.replicas, tuple) else ()
        for st in self.mix:
            if st.model and groups and not any(not g.models or st.model in g.models
                                               for g in groups):
                raise ValueError(f"mix: model {st.model!r} ({st.label()}) is served by no "
                                 "replica group")
        return self

    def replica_count(self) -> int:
        if isinstance(self.replicas, int):
            return self.replicas
        return sum(g.count for g in self.replicas)

    def needs_trace(self) -> bool:
        laws: list[object] = [self.lengths.prompt, self.lengths.output]
        for s in self.mix:
            laws += [s.prompt, s.output]
        for j in self.jobs:
            laws += [j.prompt, j.output]
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
