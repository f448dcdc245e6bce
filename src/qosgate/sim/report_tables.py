"""The simulator's report on the terminal: the scenario's header, the rich tables (per class,
tenant, tier, replica, faults, phases, gateways, limits, retries, a sweep), and the notes under
them. The JSON and CSV are ``report.py``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.table import Table

from qosgate.sim.batches_tables import (
    batches_header,
    batches_table,
    live_compare_table,
    predictions,
)
from qosgate.sim.fmt import ms as _ms
from qosgate.sim.fmt import num as _num
from qosgate.sim.fmt import pct as _pct
from qosgate.sim.fmt import seconds as _seconds
from qosgate.sim.report import WINDOW_NOTE, ledger_text
from qosgate.sim.scenario_file import describe
from qosgate.sim.scenarios import Run, ScenarioResult, attribution
from qosgate.sim.setup import PASSTHROUGH_WINDOW


def policy_label(run: Run) -> str:
    """The run's policy, with its router when several routers are compared, and ``+jobs`` for
    the run with the scenario's batch jobs beside the workload."""
    label = run.policy if run.routers == 1 else f"{run.policy} {run.router}"
    return f"{label} +jobs" if run.jobs else label


def run_label(run: Run) -> str:
    """``policy_label``, with the gateway count when there are several."""
    label = policy_label(run)
    return label if run.gateways == 1 else f"{label} {run.gateways}gw"


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


def _engine_time_table(runs: Iterable[Run]) -> Table:
    """Each tenant's engine time (its requests' share of the steps) in the arrival span after
    the warm-up, and Jain's index over the tenants of a class in it (``sim.engine_time``)."""
    t = Table(title="engine time of the tenants of a class (s; share of the class's)",
              title_justify="left")
    for col in ("policy", "class", "Jain", "tenants (engine s: prefill + decode, share)"):
        t.add_column(col, justify="left" if col in ("policy", "class") else "right")
    for run in runs:
        for i, (c, f) in enumerate(run.metrics["engine_time"].items()):
            each = "  ".join(
                f"{name} {v['engine_s']:.1f}: {v['prefill_s']:.1f} + {v['decode_s']:.1f}, "
                f"{100 * v['share']:.0f}%"
                for name, v in f["tenants"].items()
            )
            t.add_row(run_label(run) if i == 0 else "", c, _num(f["jain"], ".3f"), each)
    return t


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
        return "all"  # engine-priority, engine-fcfs: everything passes through
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
    # the runs' phases by their span: a run whose arrivals ended sooner (a shorter --duration
    # than the faults' schedule) has fewer of them, and no row where it has none
    spans: dict[tuple[float, float], list[tuple[Any, dict[str, Any]]]] = {}
    for run in runs:
        for ph in run.metrics["phases"]:
            spans.setdefault((ph["start_s"], ph["end_s"]), []).append((run, ph))
    for rows in spans.values():
        for i, (run, ph) in enumerate(rows):
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
                end_section=i == len(rows) - 1,
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
            policy_label(run), str(run.gateways), "fleet", str(g["count"]), str(g["completed"]),
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
                policy_label(run), str(run.gateways), tenant, f"{x['requests_per_minute']:g}",
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
                policy_label(run), cls, str(x["refused_first"]), str(x["served_later"]),
                str(x["served_within_slo"]), str(x["gave_up"]), _num(x["attempts_mean"], ".2f"),
                _ms(x["ttft_from_first_p50_ms"]), _ms(x["ttft_from_first_p99_ms"]),
            )
    return t


def _retry_after_table(res: ScenarioResult) -> Table:
    """Whether the Retry-After was honest: the retries, how many got in, the waits the refusals
    asked for, and how the retries spread over the seconds (``retry_after.py``)."""
    t = Table(
        title="retries after a Retry-After: sent, admitted (not refused again), the Retry-After "
        "of the refusals retried, and the most retries in one second against the mean",
        title_justify="left",
    )
    for col in ("policy", "class", "sent", "admitted", "success", "wait p50", "wait p90",
                "wait max", "busiest s", "mean/s"):
        t.add_column(col, justify="left" if col in ("policy", "class") else "right")
    for run in res.runs:
        stats = run.metrics.get("retry_after")
        if not stats:
            continue
        groups = [*stats["classes"].items(), ("all", stats["totals"])]
        for i, (name, x) in enumerate(g for g in groups if g[1]["retries_sent"]):
            t.add_row(
                policy_label(run) if i == 0 else "",
                f"[bold]{name}[/bold]" if name == "all" else name,
                str(x["retries_sent"]), str(x["retries_admitted"]),
                _pct(x["retry_success_rate"]), _seconds(x["retry_after_p50_s"]),
                _seconds(x["retry_after_p90_s"]), _seconds(x["retry_after_max_s"]),
                str(x["retries_busiest_second"]), _num(x["retries_per_second_mean"], ".1f"),
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


def _tokens(x: int) -> str:
    """Compact token counts: 950, 12.3k, 4.56M."""
    if x < 10_000:
        return str(x)
    if x < 1_000_000:
        return f"{x / 1000:.1f}k"
    return f"{x / 1_000_000:.2f}M"


def _prefix_table(runs: Iterable[Run]) -> Table:
    """Per run: the engines' prefix-cache hit rate against the trace's ideal, per replica, and
    the prefill tokens the engines computed against those offered."""
    runs = list(runs)
    # a fleet with a host KV tier: the hits include those loaded from it, and which share
    host = any("host_share" in (r.metrics.get("prefix_cache") or {}) for r in runs)
    t = Table(
        title="prefix cache (hit rate = engine hits / queries, prompt tokens at first admission; "
        + ("GPU and host-tier hits; from host = the hits loaded from host DRAM; " if host
           else "")
        + "ideal = one infinite cache over the requests as offered; fleet KV = one LRU cache of "
        "the fleet's whole KV" + (", GPU + host)" if host else ")"),
        title_justify="left",
    )
    for col in ("policy", "hit rate", *(("from host",) if host else ()), "ideal", "of ideal",
                "fleet KV", "per replica", "prefill computed", "offered", "computed/offered"):
        t.add_column(col, justify="left" if col in ("policy", "per replica") else "right")
    for run in runs:
        pc = run.metrics.get("prefix_cache")
        if not pc:
            continue
        each = "  ".join(f"{name} {_pct(r['hit_rate'])}" for name, r in pc["replicas"].items())
        t.add_row(
            run_label(run),
            _pct(pc["hit_rate"]),
            *((_pct(pc.get("host_share")),) if host else ()),
            _pct(pc["ideal_hit_rate"]),
            _num(pc["of_ideal"], ".2f"),
            _pct(pc["ideal_fleet_kv_hit_rate"]),
            each,
            _tokens(pc["prefill_tokens_computed"]),
            _tokens(pc["prefill_tokens_offered"]),
            _pct(pc["computed_of_offered"]),
        )
    return t


def _ttft_mean_table(runs: Iterable[Run], classes: tuple[str, ...]) -> Table:
    """Per run: TTFT mean and p99 of each class and of all, with goodput and output tokens/s
    (the figures a router comparison is judged by)."""
    t = Table(title="TTFT by class (mean / p99), goodput and output tokens/s",
              title_justify="left")
    t.add_column("policy", justify="left")
    for c in (*classes, "all"):
        t.add_column(c, justify="right")
    for col in ("goodput", "tok/s"):
        t.add_column(col, justify="right")
    for run in runs:
        m = run.metrics
        groups = [m["classes"].get(c, {}) for c in classes] + [m["totals"]]
        t.add_row(
            run_label(run),
            *[f"{_ms(g.get('ttft_mean_ms'))} / {_ms(g.get('ttft_p99_ms'))}" for g in groups],
            _num(m["totals"]["goodput_rps"], ".2f"),
            _num(m["totals"]["output_tok_s"], ".0f"),
        )
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
    print_tables(res, console)


def print_tables(res: ScenarioResult, console: Console) -> None:
    """The report under its header: the SLOs, the tables, the notes (``qosgate replay``
    prints its measured run with them, under a header of its own)."""
    prep = res.prep
    s = prep.scenario
    modes = sorted({p.window_mode for p in prep.fleet if p.window_mode is not None})
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
        if prep.jobs:
            console.print(batches_header(res), highlight=False)
        console.print(_group_table("per class", res.runs, "classes", "class"))
        if any(len(r.metrics["tenants"]) > 1 for r in res.runs):
            console.print(_group_table("per tenant", res.runs, "tenants", "tenant"))
            if any(len(r.metrics["tiers"]) > 1 for r in res.runs):
                console.print(_group_table("per tier", res.runs, "tiers", "tier"))
        ft = _fairness_table(res.runs)
        if ft is not None:
            console.print(ft)
        if prep.models:
            console.print(_engine_time_table(res.runs))
        if (len(prep.fleet) > 1 or "adaptive" in modes) and any(
                r.metrics["replicas"] for r in res.runs):  # a replay sees no replicas
            console.print(_replica_table(res.runs))
        if s.faults or any(r.result.fleet.get("attempt_failures") for r in res.runs):
            console.print(_faults_table(res.runs))
            pt = _phases_table(res.runs)
            if pt is not None:
                console.print(pt)
    if any(r.metrics.get("prefix_cache") for r in res.runs):
        console.print(_ttft_mean_table(res.runs, res.runs[0].result.classes))
        console.print(_prefix_table(res.runs))
    if any(r.gateways > 1 for r in res.runs):
        console.print(_gateway_table(res))
    if any(r.metrics.get("limits") for r in res.runs):
        console.print(_limits_table(res))
    if any(x["refused_first"] for r in res.runs for x in r.metrics.get("retries", {}).values()):
        console.print(_retries_table(res))
    if any(r.metrics.get("retry_after") for r in res.runs):
        console.print(_retry_after_table(res))
    if prep.jobs:
        console.print(live_compare_table(res, run_label))
        console.print(batches_table([r for r in res.runs if r.jobs], run_label))
        for line in predictions(res, run_label):
            console.print(line, highlight=False)
    console.print(f"[dim]{WINDOW_NOTE}[/dim]", highlight=False)
    console.print(ledger_text(res), highlight=False)
    note = attribution(prep)
    if note:
        console.print(f"[dim]Request data: {note}[/dim]", highlight=False)
