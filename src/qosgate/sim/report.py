"""The simulator's report as files: one JSON document (byte-identical for the same seed) and a
CSV of every group's metrics; and the statement on outcomes (``ledger_ok``, ``ledger_text``).
The tables printed on the terminal are ``report_tables.py``.

The JSON holds no wall-clock time, no absolute path and no host detail, and its floats are
rounded to 6 significant digits, so the same scenario and seed give the same bytes anywhere.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

from qosgate.sim.batches import BatchPlan
from qosgate.sim.batches_metrics import batches_ok
from qosgate.sim.retry_after import RETRY_AFTER_DEFINITIONS
from qosgate.sim.scenario_file import Gateways, describe
from qosgate.sim.scenarios import Run, ScenarioResult, attribution

FORMAT_VERSION = 2
GROUP_KINDS = {
    "classes": "class",
    "tenants": "tenant",
    "tiers": "tier",
    "streams": "stream",
    "replicas": "replica",
}
# what the rates mean (in the JSON, and said under the tables)
DEFINITIONS = {
    "goodput_rps": "requests that met both SLOs (TTFT and TPOT) and finished inside the arrival "
    "window, per second of the arrival window",
    "completed_rps": "requests completed inside the arrival window, per second of it",
    "goodput_rps_run": "requests that met both SLOs, per second of the whole run (arrival window "
    "plus the drain of the backlog)",
    "completed_rps_run": "requests completed, per second of the whole run",
    "output_tok_s": "output tokens generated inside the arrival window, per second of it",
    "slo_attainment": "requests that met both SLOs / all requests (refused and timed out count "
    "against it)",
    "admitted_ttft_met": "requests whose first token came within their class's TTFT budget / "
    "requests admitted (not refused): deadline admission's calibration, against "
    "admission.quantile",
}
WINDOW_NOTE = (
    "goodput and req/s done count only requests that finished inside the arrival window, per "
    "second of it (the drain after it is not credited); the JSON also has *_run rates over the "
    "whole run"
)


def _round(x: Any) -> Any:
    if isinstance(x, float):
        if math.isnan(x) or math.isinf(x):
            return None
        return float(f"{x:.6g}")
    if isinstance(x, dict):
        return {str(k): _round(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_round(v) for v in x]
    return x


def _replica_names(run: Run) -> list[str]:
    reps = run.result.fleet.get("replicas", [])
    assert isinstance(reps, list)
    return [str(rep["name"]) for rep in reps]


def _timeseries(run: Run) -> dict[str, Any]:
    r = run.result
    classes = r.classes
    return {
        "t": [s.t for s in r.samples],
        "queued": {c: [s.queued[i] for s in r.samples] for i, c in enumerate(classes)},
        "inflight": [s.inflight for s in r.samples],
        "replicas_up": [s.replicas_up for s in r.samples],
        "windows": {
            name: [s.windows[k] if s.windows else None for s in r.samples]
            for k, name in enumerate(_replica_names(run))
        },
        "engine_running": [s.engine_running for s in r.samples],
        "engine_waiting": [s.engine_waiting for s in r.samples],
        "engine_paused": [s.engine_paused for s in r.samples],
        "kv_usage": [s.kv_usage for s in r.samples],
    }


def one_outcome_each(run: Run) -> bool:
    """Every request of the run has exactly one outcome: one record per arrival, none left
    live, and the core's outcome ledger sums to the arrivals; and with batch jobs, every line
    of each ended once, none answered twice (``batches_metrics.batches_ok``)."""
    r = run.result
    return (
        not r.unfinished
        and len(r.records) == r.arrivals
        and len({x.rid for x in r.records}) == r.arrivals
        and sum(r.outcomes.values()) == r.arrivals
        and (not r.jobs or batches_ok(r.jobs, r.job_outcomes, r.job_attempts))
    )


def run_document(run: Run) -> dict[str, Any]:
    r = run.result
    m = run.metrics
    return {
        "policy": run.policy,
        **({"jobs_on": run.jobs} if run.jobs is not None else {}),
        "router": run.router,
        "load": run.load,
        "offered_rps": run.offered_rps,
        "arrivals": r.arrivals,
        "outcomes": r.outcomes,
        "one_outcome_each": one_outcome_each(run),
        "recorded": len(r.records),
        "lost": r.arrivals - len(r.records),
        "unfinished": r.unfinished,
        "preemptions": {"pause": r.pauses, "abort": r.aborts, "evict": r.evictions,
                        "move": r.moves, "resent_tokens": r.resent_tokens},
        "late_finishes": r.late_finishes,
        "scheduler_calls": r.scheduler_calls,
        "engine": r.engine,
        "engine_at_window_end": r.engine_window,
        "totals": m["totals"],
        "classes": m["classes"],
        "tenants": m["tenants"],
        "tiers": m["tiers"],
        "streams": m["streams"],
        "fairness": m["fairness"],
        "fleet": r.fleet,
        "replicas": m["replicas"],
        "phases": m["phases"],
        "timeseries": _timeseries(run),
        # only with several gateways or a rate limit (a single gateway's document is unchanged)
        **({"gateways": {"count": run.gateways, "shared": r.shared, "each": m["gateways"]}}
           if run.gateways > 1 else {}),
        **({"limits": m["limits"]} if m.get("limits") else {}),
        **({"retries": m["retries"]} if m.get("retries") else {}),
        # only with clients that retry (``retry_after.py``)
        **({"retry_after": m["retry_after"]} if m.get("retry_after") else {}),
        # only with a workload that carries prefixes (see ``prefix_stats``)
        **({"prefix_cache": m["prefix_cache"]} if m.get("prefix_cache") else {}),
        # only with several models (``sim.engine_time``)
        **({"engine_time": m["engine_time"]} if m.get("engine_time") else {}),
        # only with batch jobs beside the workload (``batches_metrics``)
        **({"jobs": m["jobs"], "job_attempt_outcomes": r.job_outcomes} if m.get("jobs") else {}),
    }


FEED_SETTINGS = ("default_class", "queued_per_job", "retries", "backoff_s", "backoff_max_s")


def _job_plan(jp: BatchPlan, idle_rate: float) -> dict[str, Any]:
    prompts = [p for p, _ in jp.lines]
    outputs = [o for _, o in jp.lines]
    return {
        "name": jp.name, "lines": len(jp.lines), "at_s": jp.at, "window_s": jp.completion_window_s,
        "class": jp.qos_class, "tenant": jp.tenant,
        "mean_prompt_tokens": math.fsum(prompts) / len(prompts),
        "mean_output_tokens": math.fsum(outputs) / len(outputs),
        "idle_fleet_lines_per_s": idle_rate,
    }


def document(res: ScenarioResult) -> dict[str, Any]:
    prep = res.prep
    s = prep.scenario
    prof = prep.profile
    doc: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "scenario": {
            "name": s.name,
            "description": describe(s),
            "profile": {"name": prof.name, "model": prof.model, "gpu": prof.gpu},
            "profile_overrides": dict(s.profile_overrides),
            "replicas": len(prep.fleet),
            "fleet": [
                {
                    "name": p.name,
                    "profile": p.profile.name,
                    "gpu": p.profile.gpu,
                    "window": p.window,
                    "pausable": p.pausable,
                }
                for p in prep.fleet
            ],
            "faults": [f.model_dump() for f in s.faults],
            # only when set (a single gateway's document is unchanged)
            **({"gateways": s.gateways.model_dump()} if s.gateways != Gateways() else {}),
            "probe_interval_s": s.probe_interval_s,
            "window": prep.window,
            "window_setting": s.window,
            "engine_queue": s.engine_queue,
            "policies": list(s.policies),
            "seed": s.seed,
            "duration_s": res.runs[0].result.arrivals_end if res.runs else s.duration_s,
            "warmup_s": s.warmup_s,
            "arrivals": s.arrivals.model_dump(),
            "sweep": list(s.sweep.loads) if s.sweep else None,
            "mix": [st.label() for st in s.mix],
            "mean_request_tokens": prep.mean_tokens,
            "capacity_rps": prep.capacity_rps,
            "capacity_measured": prep.capacity_measured,
            "trace": prep.trace_path.name if prep.trace_path is not None else None,
            "attribution": attribution(prep),
            # only with several models: what each replica serves, each model's profile
            **({"models": {
                "served": {p.name: list(p.models) for p in prep.fleet},
                "profiles": {m: {"name": p.name, "model": p.model, "gpu": p.gpu}
                             for m, p in prep.model_profiles.items()},
            }} if prep.models else {}),
            # only with batch jobs (a document without them is unchanged)
            **({"jobs": [_job_plan(jp, rate) for jp, rate in
                         zip(prep.jobs, prep.job_idle_rates, strict=True)],
                "batches": {k: v for k, v in s.batches.model_dump().items()
                            if k in FEED_SETTINGS}} if prep.jobs else {}),
        },
        "slo": {
            c: {"ttft_ms": v.ttft_s * 1000.0, "tpot_ms": v.tpot_s * 1000.0}
            for c, v in prep.slos.items()
        },
        # (with clients that retry, what the Retry-After figures mean too)
        "definitions": {**DEFINITIONS, **RETRY_AFTER_DEFINITIONS} if s.retries else DEFINITIONS,
        "one_outcome_each": all(one_outcome_each(r) for r in res.runs),
        "runs": [run_document(r) for r in res.runs],
    }
    return _round(doc)  # type: ignore[no-any-return]


def dumps(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=1, sort_keys=False, ensure_ascii=False, allow_nan=False) + "\n"


# ------------------------------------------------------------------------------ CSV
def csv_rows(res: ScenarioResult) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    several = any(run.gateways > 1 for run in res.runs)
    for run in res.runs:
        m = run.metrics
        base = {"policy": run.policy, "load": run.load, "offered_rps": run.offered_rps}
        if several:  # which gateway count the row is from (absent with one gateway, as before)
            base["gateways"] = run.gateways
        if run.routers > 1:  # which router (absent with one, as before)
            base["router"] = run.router
        if run.jobs is not None:  # without or with the batch jobs (absent without jobs)
            base["jobs_on"] = run.jobs
        rows.append({**base, "group_kind": "total", "group": "all", **m["totals"]})
        for kind, singular in GROUP_KINDS.items():
            for name, g in m[kind].items():
                row = {**base, "group_kind": singular, "group": name, **g}
                if kind == "classes" and name in m["fairness"]:
                    f = m["fairness"][name]
                    row["jain"] = f["jain"]
                    row["service_gap"] = f["service_gap"]
                rows.append(row)
    return [_round(r) for r in rows]


def to_csv(res: ScenarioResult) -> str:
    rows = csv_rows(res)
    fields: list[str] = []
    for r in rows:
        for k in r:
            if k not in fields:
                fields.append(k)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if v is None else v) for k, v in r.items()})
    return buf.getvalue()


def write_files(res: ScenarioResult, out: Path, doc: dict[str, Any] | None = None) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    name = res.scenario.name
    jp = out / f"{name}.json"
    jp.write_text(dumps(doc if doc is not None else document(res)), encoding="utf-8")
    cp = out / f"{name}.csv"
    cp.write_text(to_csv(res), encoding="utf-8")
    return [jp, cp]


def ledger_ok(res: ScenarioResult) -> bool:
    """Every request has exactly one outcome in every run."""
    return all(one_outcome_each(run) for run in res.runs)


def ledger_text(res: ScenarioResult) -> str:
    """The report's statement on outcomes: every request had exactly one, or which run broke it."""
    bad = [run for run in res.runs if not one_outcome_each(run)]
    if not bad:
        sizes = sorted({run.result.arrivals for run in res.runs})
        n = sizes[0] if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        failed = sum(run.metrics["totals"]["failed"] for run in res.runs)
        hit = sum(run.metrics["totals"]["failed_attempt"] for run in res.runs)
        extra = (
            f"; over all runs {failed} ended failed and {hit} had an attempt fail before their "
            "first token"
            if failed or hit
            else ""
        )
        return (
            f"outcomes: in each of the {len(res.runs)} run(s), every one of the {n} requests had "
            "exactly one outcome (completed, rejected, timed out, cancelled or failed): none lost, "
            f"none left unfinished{extra}"
        )
    lines = []
    for run in bad:
        r = run.result
        lines.append(
            f"[red]{run.policy}: {r.arrivals - len(r.records)} of {r.arrivals} requests without "
            f"an outcome ({r.unfinished} unfinished; the ledger counts "
            f"{sum(r.outcomes.values())})[/red]"
        )
    return "\n".join(lines)
