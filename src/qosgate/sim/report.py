"""The simulator's report: one JSON document (byte-identical for the same seed), a CSV of every
group's metrics, and rich tables for the terminal.

The JSON holds no wall-clock time, no absolute path and no host detail, and its floats are
rounded to 6 significant digits, so the same scenario and seed give the same bytes anywhere.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from qosgate.sim.scenarios import Gateways, Run, ScenarioResult, attribution, describe
from qosgate.sim.setup import PASSTHROUGH_WINDOW

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
    live, and the core's outcome ledger sums to the arrivals."""
    r = run.result
    return (
        not r.unfinished
        and len(r.records) == r.arrivals
        and len({x.rid for x in r.records}) == r.arrivals
        and sum(r.outcomes.values()) == r.arrivals
    )


def run_document(run: Run) -> dict[str, Any]:
    r = run.result
    m = run.metrics
    return {
        "policy": run.policy,
        "load": run.load,
        "offered_rps": run.offered_rps,
        "arrivals": r.arrivals,
        "outcomes": r.outcomes,
        "one_outcome_each": one_outcome_each(run),
        "recorded": len(r.records),
        "lost": r.arrivals - len(r.records),
        "unfinished": r.unfinished,
        "preemptions": {"pause": r.pauses, "abort": r.aborts},
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
        },
        "slo": {
            c: {"ttft_ms": v.ttft_s * 1000.0, "tpot_ms": v.tpot_s * 1000.0}
            for c, v in prep.slos.items()
        },
        "definitions": DEFINITIONS,
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


# ------------------------------------------------------------------------------ terminal
def run_label(run: Run) -> str:
    """The run's policy, with its gateway count when there are several."""
    return run.policy if run.gateways == 1 else f"{run.policy} {run.gateways}gw"


def _ms(x: float | None) -> str:
    """Compact: 356ms, 1.25s, 13.9s, 62s."""
    if x is None:
        return "-"
    if x < 1000:
        return f"{x:.0f}ms"
    if x < 10_000:
        return f"{x / 1000:.2f}s"
    if x < 100_000:
        return f"{x / 1000:.1f}s"
    return f"{x / 1000:.0f}s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _group_table(title: str, runs: Iterable[Run], kind: str, label: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in (
        "policy",
        label,
        "n",
        "done",
        "rej",
        "t/o",
        "fail",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "E2E p99",
        "SLO",
        "goodput",
        "tok/s",
    ):
        t.add_column(col, justify="left" if col in ("policy", label) else "right")
    for run in runs:
        groups = [*run.metrics[kind].items(), ("all", run.metrics["totals"])]
        for i, (name, g) in enumerate(groups):
            t.add_row(
                run_label(run) if i == 0 else "",
                f"[bold]{name}[/bold]" if name == "all" else name,
                str(g["count"]),
                str(g["completed"]),
                str(g["rejected"]),
                str(g["timed_out"]),
                str(g["failed"]),
                _ms(g["ttft_p50_ms"]),
                _ms(g["ttft_p99_ms"]),
                _ms(g["tpot_p50_ms"]),
                _ms(g["tpot_p99_ms"]),
                _ms(g["e2e_p99_ms"]),
                _pct(g["slo_attainment"]),
                _num(g["goodput_rps"], ".2f"),
                _num(g["output_tok_s"], ".0f"),
                end_section=i == len(groups) - 1,
            )
    return t


def _fairness_table(runs: Iterable[Run]) -> Table | None:
    t = Table(
        title="fairness between the tenants of a class (service / max-min fair share)",
        title_justify="left",
    )
    for col in ("policy", "class", "Jain", "gap", "tenants (service / fair share)"):
        t.add_column(col, justify="left" if col in ("policy", "class") else "right")
    any_row = False
    for run in runs:
        for i, (c, f) in enumerate(run.metrics["fairness"].items()):
            any_row = True
            ratios = "  ".join(
                f"{name} {v['ratio']:.2f}" if v["ratio"] is not None else f"{name} -"
                for name, v in f["tenants"].items()
            )
            t.add_row(
                run_label(run) if i == 0 else "",
                c,
                _num(f["jain"], ".3f"),
                _num(f["service_gap"], ".3f"),
                ratios,
            )
    return t if any_row else None


def _replica_table(runs: Iterable[Run]) -> Table:
    t = Table(
        title="per replica (requests by the replica they were last dispatched to; window: the "
        "core's, time-averaged/most if it moved)",
        title_justify="left",
    )
    for col in (
        "policy",
        "replica",
        "gpu",
        "window",
        "n",
        "done",
        "fail",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "SLO",
        "tok/s",
        "KV evict",
        "ejected",
    ):
        t.add_column(col, justify="left" if col in ("policy", "replica", "gpu") else "right")

    def val(x: object) -> str:
        return "-" if x is None else str(x)

    for run in runs:
        reps = list(run.metrics["replicas"].items())
        for i, (name, g) in enumerate(reps):
            t.add_row(
                run_label(run) if i == 0 else "",
                name,
                val(g["gpu"]).split("-")[0],
                _window(g),
                str(g["count"]),
                str(g["completed"]),
                str(g["failed"]),
                _ms(g["ttft_p99_ms"]),
                _ms(g["tpot_p50_ms"]),
                _ms(g["tpot_p99_ms"]),
                _pct(g["slo_attainment"]),
                _num(g["output_tok_s"], ".0f"),
                val(g["kv_evictions"]),
                val(g["ejections"]),
                end_section=i == len(reps) - 1,
            )
    return t


def _window(g: dict[str, Any]) -> str:
    """``748`` for a window that stayed put, ``212/748`` (time-averaged / most) for one that
    moved."""
    most = g.get("window")
    avg = g.get("window_mean")
    if most is None:
        return "-"
    if most >= PASSTHROUGH_WINDOW:
        return "all"  # engine-priority: everything passes through
    if avg is None or abs(avg - most) < 0.5:
        return str(most)
    return f"{avg:.0f}/{most}"


def _faults_table(runs: Iterable[Run]) -> Table:
    t = Table(
        title="faults: attempts that failed before the first token (by reason), the core's "
        "retries, and what became of the requests",
        title_justify="left",
    )
    for col in (
        "policy",
        "failed attempts",
        "retries",
        "requests hit",
        "hit -> done",
        "failed (streaming)",
        "failed (not started)",
        "ejections",
    ):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for run in runs:
        fleet = run.result.fleet
        fails = fleet.get("attempt_failures", {})
        retries = fleet.get("retries", {})
        assert isinstance(fails, dict) and isinstance(retries, dict)
        recs = run.result.records
        failed_streaming = sum(
            1 for r in recs if r.state == "failed" and r.first_token_at is not None
        )
        failed_cold = sum(1 for r in recs if r.state == "failed" and r.first_token_at is None)
        reps = fleet.get("replicas", [])
        assert isinstance(reps, list)
        ej = ", ".join(f"{r['name']} {r['ejections']}" for r in reps if r["ejections"]) or "0"
        g = run.metrics["totals"]
        t.add_row(
            run_label(run),
            ", ".join(f"{k.removeprefix('upstream_')} {v}" for k, v in fails.items()) or "0",
            str(sum(retries.values())),
            str(g["failed_attempt"]),
            str(g["failed_attempt_completed"]),
            str(failed_streaming),
            str(failed_cold),
            ej,
        )
    return t


def _phases_table(runs: list[Run]) -> Table | None:
    if not runs or not runs[0].metrics["phases"]:
        return None
    top = runs[0].metrics["phases"][0]["top_class"]
    t = Table(
        title=f"by phase of the fleet (requests by arrival time; hit = had a failed attempt; "
        f"{top} = the most urgent class)",
        title_justify="left",
    )
    for col in (
        "phase",
        "fleet",
        "policy",
        "n",
        "done",
        "rej",
        "t/o",
        "fail",
        "hit",
        f"{top} TTFT p99",
        f"{top} SLO",
    ):
        t.add_column(col, justify="left" if col in ("phase", "fleet", "policy") else "right")
    n_phases = len(runs[0].metrics["phases"])
    for k in range(n_phases):
        for i, run in enumerate(runs):
            ph = run.metrics["phases"][k]
            t.add_row(
                f"{ph['start_s']:g}-{ph['end_s']:g} s" if i == 0 else "",
                ph["fleet"] if i == 0 else "",
                run_label(run),
                str(ph["count"]),
                str(ph["completed"]),
                str(ph["rejected"]),
                str(ph["timed_out"]),
                str(ph["failed"]),
                str(ph["failed_attempt"]),
                _ms(ph["top_ttft_p99_ms"]),
                _pct(ph["top_slo_attainment"]),
                end_section=i == len(runs) - 1,
            )
    return t


def _gateway_table(res: ScenarioResult) -> Table:
    """Per gateway count: the fleet's and each instance's realtime TTFT p99, tenant fairness and
    engine evictions (KV preemptions)."""
    s = res.scenario
    classes = res.runs[0].result.classes if res.runs else ()
    top = classes[0] if classes else "realtime"
    fair = sorted({c for r in res.runs for c in r.metrics["fairness"]})
    shared = "shared" if s.gateways.shared else "own"
    t = Table(
        title=f"gateways (tenant state: {shared} with several; sync every "
        f"{1000 * s.gateways.sync_interval_s:g} ms, store delay "
        f"{1000 * s.gateways.sync_delay_s:g} ms, spread {s.gateways.spread})",
        title_justify="left",
    )
    cols = ["policy", "gateways", "gateway", "requests", "done", f"{top} TTFT p99",
            f"{top} SLO", *[f"Jain {c}" for c in fair], "engine preempt."]
    for col in cols:
        t.add_column(col, justify="left" if col in ("policy", "gateway") else "right")
    for run in res.runs:
        m = run.metrics
        g = m["totals"]
        rt = m["classes"].get(top, {})
        t.add_row(
            run.policy, str(run.gateways), "fleet", str(g["count"]), str(g["completed"]),
            _ms(rt.get("ttft_p99_ms")), _pct(rt.get("slo_attainment")),
            *[_num((m["fairness"].get(c) or {}).get("jain"), ".3f") for c in fair],
            f"{run.result.engine.get('kv_evictions', 0):.0f}",
        )
        if run.gateways > 1:
            for gw in m["gateways"]:
                t.add_row(
                    "", "", f"gw{gw['gateway']}", str(gw["count"]), str(gw["completed"]),
                    _ms(gw["top_ttft_p99_ms"]), _pct(gw["top_slo_attainment"]),
                    *[_num(gw["jain"].get(c), ".3f") for c in fair],
                    str(gw["engine_evictions"]),
                )
    return t


def _limits_table(res: ScenarioResult) -> Table:
    """A requests/min limit over the gateways: admitted against R + refill."""
    t = Table(
        title="requests/min limits over the gateways (admitted vs R + R x span / 60)",
        title_justify="left",
    )
    for col in ("policy", "gateways", "tenant", "R/min", "offered", "admitted", "R + refill",
                "overshoot", "admitted per gateway"):
        t.add_column(col, justify="left" if col in ("policy", "tenant") else "right")
    for run in res.runs:
        for tenant, x in run.metrics.get("limits", {}).items():
            t.add_row(
                run.policy, str(run.gateways), tenant, f"{x['requests_per_minute']:g}",
                str(x["offered"]), str(x["admitted"]), f"{x['allowed']:.1f}",
                f"{x['overshoot']:+.1f}", " ".join(str(a) for a in x["admitted_per_gateway"]),
            )
    return t


def _retries_table(res: ScenarioResult) -> Table:
    """Clients that honour Retry-After: what became of the requests refused at first."""
    t = Table(
        title=f"clients honouring Retry-After (up to {res.scenario.retries} retries): requests "
        "whose first attempt was refused (* and SLO: from the first attempt's arrival)",
        title_justify="left",
    )
    for col in ("policy", "class", "refused", "served later", "within SLO", "gave up",
                "attempts", "TTFT p50*", "TTFT p99*"):
        t.add_column(col, justify="left" if col in ("policy", "class") else "right")
    for run in res.runs:
        for cls, x in run.metrics.get("retries", {}).items():
            if not x["refused_first"]:
                continue
            t.add_row(
                run.policy, cls, str(x["refused_first"]), str(x["served_later"]),
                str(x["served_within_slo"]), str(x["gave_up"]), _num(x["attempts_mean"], ".2f"),
                _ms(x["ttft_from_first_p50_ms"]), _ms(x["ttft_from_first_p99_ms"]),
            )
    return t


def _sweep_table(res: ScenarioResult) -> Table:
    classes = res.runs[0].result.classes if res.runs else ()
    top = classes[0] if classes else "realtime"
    t = Table(
        title="latency against offered load (TTFT = time to first token, E2E = response time)",
        title_justify="left",
    )
    for col in (
        "load",
        "policy",
        "req/s in",
        "req/s done",
        "out tok/s",
        "TTFT mean",
        "TTFT p99",
        "E2E mean",
        "queue (mean)",
        f"{top} TTFT p99",
        f"{top} SLO",
        "t/o+rej",
    ):
        t.add_column(col, justify="right")
    last: float | None = None
    for run in res.runs:
        m = run.metrics
        g = m["totals"]
        rt = m["classes"].get(top, {})
        t.add_row(
            f"{100 * run.load:.0f}%" if run.load is not None and run.load != last else "",
            run_label(run),
            f"{run.offered_rps:.1f}",
            _num(g["completed_rps"]),
            _num(g["output_tok_s"], ".0f"),
            _ms(g["ttft_mean_ms"]),
            _ms(g["ttft_p99_ms"]),
            _ms(g["e2e_mean_ms"]),
            _num(g["queue_depth_mean"], ".0f"),
            _ms(rt.get("ttft_p99_ms")),
            _pct(rt.get("slo_attainment")),
            str(g["timed_out"] + g["rejected"]),
        )
        last = run.load
    return t


def _fault_text(res: ScenarioResult) -> str | None:
    s = res.scenario
    if not s.faults:
        return None
    parts = []
    for f in s.faults:
        until = f" until {f.until_s:g} s" if f.until_s is not None else ""
        if f.kind == "die":
            back = f", restarted empty at {f.until_s:g} s" if f.until_s is not None else ""
            parts.append(f"{f.name()} dies at {f.at_s:g} s{back}")
        else:
            parts.append(f"{f.name()} steps x{f.factor:g} from {f.at_s:g} s{until}")
    return (
        "faults: " + "; ".join(parts) + f" (health probe every {s.probe_interval_s:g} s)"
    )


def print_report(res: ScenarioResult, console: Console) -> None:
    prep = res.prep
    s = prep.scenario
    cap = f"{prep.capacity_rps:.2f} req/s" if prep.capacity_rps else "not measured"
    if prep.uniform:
        engine = f"engine {prep.profile.name} x{len(prep.fleet)}, window {prep.window}/replica"
        if not prep.fleet[0].pausable:
            engine += " (not pausable)"
    else:
        engine = f"engines {prep.fleet_text()}"
    modes = sorted({p.window_mode for p in prep.fleet if p.window_mode is not None})
    if modes:  # asked for by the scenario or --window-mode (unset: the core's default)
        engine += f", window mode {'/'.join(modes)}"
        if "adaptive" in modes:
            engine += " (the window above is the ceiling)"
    console.print(
        f"[bold]{s.name}[/bold] — {describe(s)}\n{engine}, capacity {cap}, seed {s.seed}",
        highlight=False,
    )
    faults = _fault_text(res)
    if faults:
        console.print(faults, highlight=False)
    slos = ", ".join(
        f"{c} TTFT {v.ttft_s * 1000:g} ms / TPOT {v.tpot_s * 1000:g} ms"
        for c, v in prep.slos.items()
    )
    console.print(f"SLOs: {slos}")
    if s.sweep:
        console.print(_sweep_table(res))
    else:
        head = res.runs[0] if res.runs else None
        if head is not None:
            load = f", offered load {head.load:.2f}x" if head.load is not None else ""
            console.print(
                f"{head.result.arrivals} requests at {head.offered_rps:.2f} req/s{load}, "
                f"arrival window {head.result.arrivals_end:.0f} s"
            )
        console.print(_group_table("per class", res.runs, "classes", "class"))
        if any(len(r.metrics["tenants"]) > 1 for r in res.runs):
            console.print(_group_table("per tenant", res.runs, "tenants", "tenant"))
            if any(len(r.metrics["tiers"]) > 1 for r in res.runs):
                console.print(_group_table("per tier", res.runs, "tiers", "tier"))
        ft = _fairness_table(res.runs)
        if ft is not None:
            console.print(ft)
        if len(prep.fleet) > 1 or "adaptive" in modes:
            console.print(_replica_table(res.runs))
        if s.faults or any(r.result.fleet.get("attempt_failures") for r in res.runs):
            console.print(_faults_table(res.runs))
            pt = _phases_table(res.runs)
            if pt is not None:
                console.print(pt)
    if any(r.gateways > 1 for r in res.runs):
        console.print(_gateway_table(res))
    if any(r.metrics.get("limits") for r in res.runs):
        console.print(_limits_table(res))
    if any(x["refused_first"] for r in res.runs for x in r.metrics.get("retries", {}).values()):
        console.print(_retries_table(res))
    console.print(f"[dim]{WINDOW_NOTE}[/dim]", highlight=False)
    console.print(ledger_text(res), highlight=False)
    note = attribution(prep)
    if note:
        console.print(f"[dim]Request data: {note}[/dim]", highlight=False)


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
