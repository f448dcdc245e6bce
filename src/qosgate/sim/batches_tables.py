"""The simulator's report on batch jobs, on the terminal: each job's run (lines by outcome, start,
end, completion time against its window, output tokens/s, the estimates), the live classes
without and with the jobs side by side, and the prediction in one sentence per job."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from qosgate.sim.fmt import ms as _ms
from qosgate.sim.fmt import num as _num
from qosgate.sim.fmt import pct as _pct
from qosgate.sim.scenarios import Run, ScenarioResult


def _s(x: float | None) -> str:
    """Seconds, compact: 950 s, 24.1 min, 3.20 h."""
    if x is None:
        return "-"
    if x < 1000:
        return f"{x:.0f} s"
    if x < 3 * 3600:
        return f"{x / 60:.1f} min"
    return f"{x / 3600:.2f} h"


def batches_header(res: ScenarioResult) -> str:
    """``jobs: job1 20000 lines at 0 s, window 60.0 min, class batch (mean 1155 + 211 tokens)``"""
    parts = []
    for jp in res.prep.jobs:
        n = len(jp.lines)
        prompt = sum(p for p, _ in jp.lines) / n
        output = sum(o for _, o in jp.lines) / n
        who = f", tenant {jp.tenant}" if jp.tenant else ""
        parts.append(f"{jp.name} {n} lines at {_s(jp.at)}, window {_s(jp.completion_window_s)}, "
                     f"class {jp.qos_class}{who} (mean {prompt:.0f} prompt + {output:.0f} output "
                     "tokens a line)")
    b = res.scenario.batches
    return (f"jobs: {'; '.join(parts)}; fed {b.queued_per_job} queued beyond the fleet's "
            f"windows, {b.retries} retries")


def batches_table(runs: list[Run], label: Any) -> Table:
    t = Table(
        title="batch jobs (done by = last answer - submission; idle = the job alone on the "
        "fleet; spare = on what live arrivals leave, a fluid estimate)",
        title_justify="left",
    )
    for col in ("policy", "job", "class", "lines", "done", "failed", "expired", "done by",
                "window", "of window", "out tok/s", "idle", "spare"):
        t.add_column(col, justify="left" if col in ("policy", "job", "class") else "right")
    for run in runs:
        jobs = list(run.metrics.get("jobs", {}).items())
        for i, (name, j) in enumerate(jobs):
            served = "/".join(j["served_classes"]) or j["class"]
            t.add_row(
                label(run) if i == 0 else "", name, served, str(j["lines"]), str(j["done"]),
                str(j["failed"]), str(j["expired"]), _s(j["completion_s"]), _s(j["window_s"]),
                _pct(j["of_window"]),
                _num(j["output_tok_s"], ".0f"),
                _s(j["idle_fleet_s"]), _s(j["spare_capacity_s"]),
                end_section=i == len(jobs) - 1,
            )
    return t


def live_compare_table(res: ScenarioResult, label: Any) -> Table:
    """Per policy and live class: the figures without the jobs -> with them."""
    t = Table(title="live classes without -> with the jobs (same requests, same seed)",
              title_justify="left")
    for col in ("policy", "class", "done", "TTFT p50", "TTFT p99", "TPOT p99", "SLO", "SLO diff",
                "tok/s"):
        t.add_column(col, justify="left" if col in ("policy", "class") else "right")
    base = {_key(r): r for r in res.runs if r.jobs is False}
    for run in (r for r in res.runs if r.jobs):
        off = base.get(_key(run))
        if off is None:
            continue
        names = [*run.metrics["classes"], "all"]
        for i, c in enumerate(names):
            a = off.metrics["totals"] if c == "all" else off.metrics["classes"].get(c, {})
            b = run.metrics["totals"] if c == "all" else run.metrics["classes"].get(c, {})

            def pair(key: str, fmt: Any, a: dict[str, Any] = a, b: dict[str, Any] = b) -> str:
                return f"{fmt(a.get(key))} -> {fmt(b.get(key))}"

            sa, sb = a.get("slo_attainment"), b.get("slo_attainment")
            diff = "-" if sa is None or sb is None else f"{100 * (sb - sa):+.1f} pt"
            t.add_row(
                label(off) if i == 0 else "", f"[bold]{c}[/bold]" if c == "all" else c,
                pair("completed", str), pair("ttft_p50_ms", _ms), pair("ttft_p99_ms", _ms),
                pair("tpot_p99_ms", _ms), pair("slo_attainment", _pct), diff,
                pair("output_tok_s", lambda x: _num(x, ".0f")),
                end_section=i == len(names) - 1,
            )
    return t


def _key(run: Run) -> tuple[str, str, int, float | None]:
    return run.policy, run.router, run.gateways, run.load


def predictions(res: ScenarioResult, label: Any) -> list[str]:
    """One sentence per job and run: the simulated completion time is the prediction."""
    out = []
    for run in (r for r in res.runs if r.jobs):
        for name, j in run.metrics.get("jobs", {}).items():
            if j["completion_s"] is None:
                out.append(f"prediction ({label(run)}): {name} did not end within the run")
                continue
            verdict = ("within its window" if j["within_window"] else
                       f"NOT within its window ({j['done']} of {j['lines']} lines answered)")
            out.append(
                f"prediction ({label(run)}): {name}'s {j['lines']} lines take "
                f"{_s(j['completion_s'])} from submission, {verdict} of {_s(j['window_s'])} "
                f"({_pct(j['of_window'])}); alone on an idle fleet {_s(j['idle_fleet_s'])}, "
                f"at today's spare capacity (fluid estimate) {_s(j['spare_capacity_s'])}"
            )
    return out
