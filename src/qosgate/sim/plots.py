"""PNG plots of a simulated scenario (matplotlib, Agg backend: no display needed).

- ``<scenario>-ttft-cdf.png``: the TTFT distribution (CDF) of each class, one line per policy,
  with the class's TTFT SLO marked.
- ``<scenario>-queue-depth.png``: requests waiting over time (qosgate's queue per class, and the
  engines' own waiting queues), one panel per policy, all on one y-scale; below them, the most
  urgent class's TTFT over time (p99 per time bin, by arrival; a request never served counts as
  infinitely late), one line per policy. A scenario's faults are shaded on every panel.
- ``<scenario>-latency-vs-load.png`` (sweeps): mean and p99 TTFT, mean E2E, and the first class's
  p99 TTFT against offered load, one line per policy.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from qosgate.sim.metrics import ttft
from qosgate.sim.report_tables import run_label
from qosgate.sim.scenarios import Run, ScenarioResult, attribution

_STYLE = {
    "fifo": ("#7f7f7f", "-"),
    "priority": ("#1f77b4", "-"),
    "wfq": ("#9467bd", "-"),
    "qos": ("#d62728", "-"),
    "engine-priority": ("#2ca02c", "--"),
    "engine-fcfs": ("#8c564b", "--"),
}
_CLASS_COLORS = ["#d62728", "#ff7f0e", "#1f77b4", "#7f7f7f", "#2ca02c", "#9467bd", "#8c564b"]


def _style(policy: str) -> tuple[str, str]:
    return _STYLE.get(policy, ("#17becf", "-"))


def _footer(fig: Any, res: ScenarioResult) -> None:
    s = res.scenario
    text = f"qosgate simulate --scenario {s.name} (seed {s.seed}); engine {res.prep.profile.name}"
    note = attribution(res.prep)
    if note:
        text += "\nrequest data: " + note
    fig.text(0.01, 0.005, text, fontsize=6.5, color="#555555", va="bottom", wrap=True)


def ttft_cdf(res: ScenarioResult, path: Path, runs: list[Run] | None = None) -> Path:
    runs = runs if runs is not None else res.runs
    classes = list(runs[0].result.classes)
    n = len(classes)
    cols = min(n, 2) if n > 1 else 1
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, 3.6 * rows + 0.6), squeeze=False)
    for k, cls in enumerate(classes):
        ax = axes[k // cols][k % cols]
        slo = res.prep.slos[cls].ttft_s
        for run in runs:
            xs = sorted(
                t
                for r in run.result.records
                if r.service_class == cls and (t := ttft(r)) is not None
            )
            total = sum(1 for r in run.result.records if r.service_class == cls)
            if not xs or not total:
                continue
            ys = [(i + 1) / total for i in range(len(xs))]  # not completed: never reach 1
            color, ls = _style(run.policy)
            ax.step(xs, ys, where="post", color=color, linestyle=ls, label=run_label(run), lw=1.4)
        ax.axvline(slo, color="black", lw=0.8, linestyle=":")
        ax.text(slo, 0.02, f" SLO {slo:g} s", fontsize=7, va="bottom")
        ax.set_xscale("log")
        ax.set_ylim(0, 1.02)
        ax.set_title(f"{cls}: TTFT CDF", fontsize=10)
        ax.set_xlabel("time to first token (s, log)")
        ax.set_ylabel("fraction of all requests")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=7, loc="upper left")
    for k in range(n, rows * cols):
        axes[k // cols][k % cols].set_visible(False)
    fig.suptitle(
        f"{res.scenario.name}: TTFT per class (curves stop below 1: rejected/timed out)",
        fontsize=11,
    )
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    _footer(fig, res)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _shade_faults(ax: Any, res: ScenarioResult, end: float, label: bool = False) -> None:
    for f in res.scenario.faults:
        stop = f.until_s if f.until_s is not None else end
        if f.kind == "die":
            color, text = "#999999", f"{f.name()} down"
        else:
            color, text = "#ff7f0e", f"{f.name()} slow x{f.factor:g}"
        ax.axvspan(f.at_s, stop, color=color, alpha=0.12, lw=0, label=text if label else None)


def _p99_inf(xs: list[float]) -> float:
    """p99 of ``xs`` where a value may be inf (never served): inf when the rank lands on one."""
    xs.sort()
    h = (len(xs) - 1) * 0.99
    lo = int(h)
    hi = min(lo + 1, len(xs) - 1)
    if math.isinf(xs[hi]):
        return math.inf
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def ttft_over_time(run: Run, cls: str, bins: int = 40) -> tuple[list[float], list[float]]:
    """(bin centre, p99 TTFT in s) of ``cls``'s requests by arrival time over the arrival span;
    a request that never got a first token counts as infinitely late."""
    r = run.result
    end = r.arrivals_end
    width = end / bins if end > 0 else 1.0
    groups: list[list[float]] = [[] for _ in range(bins)]
    for rec in r.records:
        if rec.service_class != cls or rec.arrival >= end:
            continue
        t = ttft(rec)
        groups[min(bins - 1, int(rec.arrival / width))].append(math.inf if t is None else t)
    xs: list[float] = []
    ys: list[float] = []
    for k, g in enumerate(groups):
        if g:
            xs.append((k + 0.5) * width)
            ys.append(_p99_inf(g))
    return xs, ys


def queue_depth(res: ScenarioResult, path: Path, runs: list[Run] | None = None) -> Path:
    runs = runs if runs is not None else res.runs
    n = len(runs)
    fig, axes = plt.subplots(
        n + 1, 1, figsize=(9, 2.4 * (n + 1) + 0.8), sharex=True, squeeze=False
    )
    top = 0.0
    for k, run in enumerate(runs):
        ax = axes[k][0]
        if k:
            ax.sharey(axes[0][0])  # one y-scale for every policy
        r = run.result
        ts = [s.t for s in r.samples]
        for i, cls in enumerate(r.classes):
            depth = [s.queued[i] for s in r.samples]
            top = max(top, *depth) if depth else top
            ax.plot(
                ts,
                depth,
                color=_CLASS_COLORS[i % len(_CLASS_COLORS)],
                lw=1.2,
                label=f"qosgate queue: {cls}",
            )
        waiting = [s.engine_waiting for s in r.samples]
        top = max(top, *waiting) if waiting else top
        ax.plot(
            ts,
            waiting,
            color="black",
            lw=1.0,
            linestyle="--",
            label="engines' waiting queues",
        )
        _shade_faults(ax, res, r.arrivals_end, label=k == 0)
        ax.axvline(r.arrivals_end, color="#999999", lw=0.8, linestyle=":")
        ax.set_title(run_label(run), fontsize=10, loc="left")
        ax.set_ylabel("requests waiting")
        ax.grid(True, alpha=0.25)
        if k == 0:
            ax.legend(fontsize=7, ncol=3, loc="upper left")
    axes[0][0].set_ylim(0, max(1.0, top) * 1.08)
    # the most urgent class's TTFT over time
    ax = axes[n][0]
    cls = runs[0].result.classes[0] if runs and runs[0].result.classes else ""
    slo = res.prep.slos[cls].ttft_s if cls in res.prep.slos else None
    finite_max = 0.0
    lines = []
    for run in runs:
        xs, ys = ttft_over_time(run, cls)
        finite_max = max([finite_max, *(y for y in ys if not math.isinf(y))])
        lines.append((run, xs, ys))
    ceiling = max(finite_max, slo or 0.0, 1e-3) * 2.0
    for run, xs, ys in lines:
        color, ls = _style(run.policy)
        ax.plot(
            xs,
            [min(y, ceiling) for y in ys],
            color=color,
            linestyle=ls,
            lw=1.3,
            marker=".",
            ms=3,
            label=run_label(run),
        )
        lost = [x for x, y in zip(xs, ys, strict=True) if math.isinf(y)]
        if lost:
            ax.plot(lost, [ceiling] * len(lost), "x", color=color, ms=5)
    if slo is not None:
        ax.axhline(slo, color="black", lw=0.8, linestyle=":")
        ax.text(0, slo, f" {cls} SLO {slo:g} s", fontsize=7, va="bottom")
    end = runs[0].result.arrivals_end if runs else 0.0
    _shade_faults(ax, res, end)
    ax.set_yscale("log")
    ax.set_title(
        f"{cls}: TTFT p99 over time (by arrival; x at the top: over 1% never served)",
        fontsize=10,
        loc="left",
    )
    ax.set_ylabel("TTFT p99 (s, log)")
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, ncol=len(runs), loc="upper left")
    axes[-1][0].set_xlabel("virtual time (s); dotted: end of arrivals")
    fig.suptitle(f"{res.scenario.name}: queue depth and {cls} TTFT over time", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    _footer(fig, res)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_vs_load(res: ScenarioResult, path: Path) -> Path:
    policies = list(dict.fromkeys(r.policy for r in res.runs))
    classes = res.runs[0].result.classes
    top = classes[0]

    def metric(kind: str, name: str, key: str) -> Callable[[dict[str, Any]], float | None]:
        def get(m: dict[str, Any]) -> float | None:
            g = m[kind] if kind == "totals" else m[kind].get(name, {})
            v = g.get(key)
            return None if v is None else float(v)

        return get

    panels: list[tuple[str, Callable[[dict[str, Any]], float | None]]] = [
        ("TTFT mean (s)", metric("totals", "", "ttft_mean_ms")),
        ("TTFT p99 (s)", metric("totals", "", "ttft_p99_ms")),
        ("E2E mean (s)", metric("totals", "", "e2e_mean_ms")),
        (f"{top} TTFT p99 (s)", metric("classes", top, "ttft_p99_ms")),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.4), squeeze=False)
    slo = res.prep.slos[top].ttft_s
    for k, (title, get) in enumerate(panels):
        ax = axes[k // 2][k % 2]
        for pol in policies:
            pts = [
                (r.load, y)
                for r in res.runs
                if r.policy == pol and r.load is not None and (y := get(r.metrics)) is not None
            ]
            if not pts:
                continue
            color, ls = _style(pol)
            ax.plot(
                [100 * x for x, _ in pts],
                [y / 1000.0 for _, y in pts],
                marker="o",
                ms=3.5,
                color=color,
                linestyle=ls,
                label=pol,
            )
        if k == 3:
            ax.axhline(slo, color="black", lw=0.8, linestyle=":")
            ax.text(50, slo, f" {top} SLO {slo:g} s", fontsize=7, va="bottom")
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("offered load (% of capacity)")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(fontsize=7)
    fig.suptitle(f"{res.scenario.name}: latency against offered load", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 0.97))
    _footer(fig, res)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_plots(res: ScenarioResult, out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    name = res.scenario.name
    paths: list[Path] = []
    if not res.runs:
        return paths
    if res.scenario.sweep:
        paths.append(latency_vs_load(res, out / f"{name}-latency-vs-load.png"))
        # the distributions at the highest load
        top = max(r.load or 0.0 for r in res.runs)
        runs = [r for r in res.runs if (r.load or 0.0) == top]
    else:
        runs = res.runs
    paths.append(ttft_cdf(res, out / f"{name}-ttft-cdf.png", runs))
    paths.append(queue_depth(res, out / f"{name}-queue-depth.png", runs))
    return paths
