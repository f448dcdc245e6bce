"""PNG plots of a simulated scenario (matplotlib, Agg backend: no display needed).

- ``<scenario>-ttft-cdf.png``: the TTFT distribution (CDF) of each class, one line per policy,
  with the class's TTFT SLO marked.
- ``<scenario>-queue-depth.png``: requests waiting over time (qosgate's queue per class, and the
  engine's own waiting queue), one panel per policy.
- ``<scenario>-latency-vs-load.png`` (sweeps): mean and p99 TTFT, mean E2E, and the first class's
  p99 TTFT against offered load, one line per policy.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from qosgate.sim.metrics import ttft
from qosgate.sim.scenarios import Run, ScenarioResult, attribution

_STYLE = {
    "fifo": ("#7f7f7f", "-"),
    "priority": ("#1f77b4", "-"),
    "wfq": ("#9467bd", "-"),
    "qos": ("#d62728", "-"),
    "engine-priority": ("#2ca02c", "--"),
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
            ax.step(xs, ys, where="post", color=color, linestyle=ls, label=run.policy, lw=1.4)
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


def queue_depth(res: ScenarioResult, path: Path, runs: list[Run] | None = None) -> Path:
    runs = runs if runs is not None else res.runs
    n = len(runs)
    fig, axes = plt.subplots(n, 1, figsize=(9, 2.4 * n + 0.8), sharex=True, squeeze=False)
    for k, run in enumerate(runs):
        ax = axes[k][0]
        r = run.result
        ts = [s.t for s in r.samples]
        for i, cls in enumerate(r.classes):
            ax.plot(
                ts,
                [s.queued[i] for s in r.samples],
                color=_CLASS_COLORS[i % len(_CLASS_COLORS)],
                lw=1.2,
                label=f"qosgate queue: {cls}",
            )
        ax.plot(
            ts,
            [s.engine_waiting for s in r.samples],
            color="black",
            lw=1.0,
            linestyle="--",
            label="engine waiting queue",
        )
        ax.axvline(r.window_end, color="#999999", lw=0.8, linestyle=":")
        ax.set_title(f"{run.policy}", fontsize=10, loc="left")
        ax.set_ylabel("requests waiting")
        ax.grid(True, alpha=0.25)
        if k == 0:
            ax.legend(fontsize=7, ncol=3, loc="upper left")
    axes[-1][0].set_xlabel("virtual time (s); dotted: end of arrivals")
    fig.suptitle(f"{res.scenario.name}: queue depth over time", fontsize=11)
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
