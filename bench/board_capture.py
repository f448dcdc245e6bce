"""A capture of the Grafana board's data (docs/img/operations-board.png) from a real Prometheus.

Grafana cannot run here, so this starts what the board watches — two vLLM stand-ins, Redis, a
gateway with three tenants and a tight realtime budget, and a real ``prometheus`` scraping it
every second with ``deploy/prometheus/qosgate.rules.yml`` (its ``for:`` cut to 10 s) — drives a
staged load, then asks Prometheus (``/api/v1/query_range``) for a selection of the board's own
expressions (as ``deploy/grafana/qosgate.json`` has them, variables at "All") and plots them with
matplotlib, one panel per board panel, the stages shaded:

1. steady mixed load (every class, three tenants, one over its limit, cancels, embeddings);
2. both stand-ins slowed ``--slow-factor`` times (an overload: queues grow, realtime TTFT passes
   its budget);
3. replica ``b`` killed (SIGKILL) and Redis killed, the load going on against replica ``a``.

    .venv/bin/python bench/board_capture.py [--stage-s 25] [--out docs/img/operations-board.png]

Prints the stages' times, the alerts that fired and when, and a few of the plotted numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support.observability import (  # noqa: E402
    BOARD,
    REALTIME_BUDGET_MS,
    RULES,
    Stack,
    chat,
    short_for,
    substitute,
)
from tests.support.processes import MODEL  # noqa: E402

RATE = "10s"
# (board panel title, y label, the series to plot (a regex on the legend), log scale)
PANELS: list[tuple[str, str, str, bool]] = [
    ("Queue depth", "requests queued", ".*", False),
    ("TTFT p50 / p99 vs budget", "seconds (log)", "(realtime|api) (p50|p99|budget)", True),
    ("SLO attainment", "fraction met", ".*", False),
    ("Outcomes by reason (not completed)", "requests/s", ".*", False),
    ("Share of service vs fair share", "share", ".*", False),
    ("In flight vs window", "requests", ".*", False),
    ("Health: up, eligible, breaker open", "0/1", ".*", False),
    ("Signals scrape age", "seconds", ".*", False),
    ("CPU", "cores; CPU s per request", ".*", False),
]
COLORS = ["#d62728", "#ff7f0e", "#1f77b4", "#7f7f7f", "#2ca02c", "#9467bd", "#8c564b",
          "#17becf", "#bcbd22", "#e377c2"]


def load_worker(st: Stack, stop: threading.Event, seed: int) -> None:
    """One client loop: a weighted mix of the classes and tenants until ``stop``."""
    rng = random.Random(seed)
    acme, beta, free = st.client("sk-acme"), st.client("sk-beta"), st.client("sk-free")
    long_prompt = "word " * 600
    jobs: list[tuple[float, Callable[[], object]]] = [
        (4, lambda: chat(acme, "realtime", 8, stream=True)),
        (2, lambda: chat(beta, "realtime", 8)),
        (3, lambda: chat(beta, "api", 24)),
        (2, lambda: chat(acme, "api", 24, stream=True)),
        (2, lambda: chat(acme, "batch", 64, long_prompt, stream=True)),
        (2, lambda: chat(beta, "offline", 64, long_prompt)),
        (1, lambda: chat(free, "api", 8)),
        (0.3, lambda: chat(beta, "batch", 200, stream=True, cancel=True)),
        (0.5, lambda: beta.embeddings.create(model=MODEL, input=["a b c", "d e"])),
    ]
    weights = [w for w, _ in jobs]
    while not stop.is_set():
        _, job = rng.choices(jobs, weights)[0]
        with contextlib.suppress(Exception):  # a dead replica's errors are part of the load
            job()
        time.sleep(rng.uniform(0.0, 0.1))


def run(stage_s: float, slow_factor: float, out: Path, workers: int) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="board-capture-"))
    st = Stack(tmp, short_for(RULES.read_text(), "10s"))
    prom = st.prom
    stop = threading.Event()
    threads = [threading.Thread(target=load_worker, args=(st, stop, i), daemon=True)
               for i in range(workers)]
    fired: dict[str, float] = {}

    def watch_alerts() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):  # Prometheus stopping
                for name in prom.alerts():
                    fired.setdefault(name, time.time())
            time.sleep(0.5)

    try:
        t0 = time.time()
        for t in threads:
            t.start()
        watcher = threading.Thread(target=watch_alerts, daemon=True)
        watcher.start()
        stages = [("steady", t0)]
        time.sleep(stage_s)
        for i in (0, 1):
            st.fault(i, {"fault": "slow", "factor": slow_factor})
        stages.append((f"engines {slow_factor:g}x slower", time.time()))
        time.sleep(stage_s)
        for i in (0, 1):
            st.fault(i, None)
        st.standins[1].proc.kill()
        st.redis.kill()
        stages.append(("replica b + Redis killed", time.time()))
        time.sleep(stage_s)
        t1 = time.time()
        stop.set()
        for t in threads:
            t.join(timeout=60)
        time.sleep(2)  # the last scrape and rule evaluation
        data = query_panels(st, t0, t1)
        plot(data, stages, t0, t1, out, slow_factor)
        print("stages: " + ", ".join(f"{name} at {t - t0:.0f} s" for name, t in stages)
              + f", end at {t1 - t0:.0f} s")
        print("alerts fired: " + (", ".join(f"{n} at {t - t0:.0f} s"
                                            for n, t in sorted(fired.items(), key=lambda x: x[1]))
                                  or "none"))
        summarize(data, stages, t0, t1)
        print(f"wrote {out}")
    finally:
        stop.set()
        st.close()


def query_panels(st: Stack, t0: float, t1: float) -> dict[str, list[tuple[str, list[Any]]]]:
    board = json.loads(BOARD.read_text())
    by_title = {p["title"]: p for p in board["panels"] if p.get("targets")}
    out: dict[str, list[tuple[str, list[Any]]]] = {}
    for title, _, _, _ in PANELS:
        series: list[tuple[str, list[Any]]] = []
        for t in by_title[title]["targets"]:
            for r in st.prom.query_range(substitute(t["expr"], RATE), t0, t1, 1.0):
                legend = t["legendFormat"]
                for k, v in r["metric"].items():
                    legend = legend.replace("{{" + k + "}}", v)
                series.append((legend, r["values"]))
        out[title] = series
    return out


def plot(data: dict[str, list[tuple[str, list[Any]]]], stages: list[tuple[str, float]],
         t0: float, t1: float, out: Path, slow_factor: float) -> None:
    fig, axes = plt.subplots(3, 3, figsize=(16, 11.5))
    for ax, (title, ylabel, pick, log) in zip(axes.flat, PANELS, strict=True):
        shown = [(n, v) for n, v in sorted(data[title]) if re.fullmatch(pick, n)]
        for k, (legend, values) in enumerate(shown):
            xs = [float(t) - t0 for t, _ in values]
            ys = [float(v) for _, v in values]
            dashed = any(w in legend for w in ("budget", "window", "fair", "starving"))
            ax.plot(xs, ys, color=COLORS[k % len(COLORS)], lw=1.3,
                    ls="--" if dashed else "-", label=legend)
        for i, (_, start) in enumerate(stages[1:], 1):
            end = stages[i + 1][1] if i + 1 < len(stages) else t1
            ax.axvspan(start - t0, end - t0, color=("#fdd0a2", "#fcbba1")[i % 2], alpha=0.35,
                       lw=0)
        if log:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_xlim(0, t1 - t0)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="upper left", ncol=2, framealpha=0.7)
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("seconds", fontsize=8)
    names = " | ".join(f"{n} from {t - t0:.0f} s" for n, t in stages)
    fig.suptitle(f"qosgate board, rendered from a real Prometheus (query_range, step 1 s, "
                 f"$__rate_interval={RATE}); realtime budget {REALTIME_BUDGET_MS} ms\n{names}",
                 fontsize=10)
    fig.text(0.01, 0.005, "bench/board_capture.py: two vLLM stand-ins (not vLLM), Redis, one "
             "gateway, prometheus 2.42 scraping every 1 s; panels are the board's own "
             "expressions from deploy/grafana/qosgate.json; shaded: engines slowed "
             f"{slow_factor:g}x, then replica b and Redis killed", fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.02, 1, 0.95))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def _window(values: list[Any], a: float, b: float) -> list[float]:
    return [float(v) for t, v in values if a <= float(t) < b and v not in ("NaN", "+Inf")]


def summarize(data: dict[str, list[tuple[str, list[Any]]]], stages: list[tuple[str, float]],
              t0: float, t1: float) -> None:
    bounds = [*(t for _, t in stages), t1]
    for title, legend in (("TTFT p50 / p99 vs budget", "realtime p99"),
                          ("Queue depth", "batch"), ("Queue depth", "offline"),
                          ("SLO attainment", "realtime"), ("CPU", "cores")):
        for name, values in data[title]:
            if not name.endswith(legend) and name != legend:
                continue
            parts = []
            for (stage, _), a, b in zip(stages, bounds, bounds[1:], strict=False):
                w = _window(values, a, b)
                if w:
                    parts.append(f"{stage}: min {min(w):.3g} max {max(w):.3g}")
            print(f"{title} [{name}]: " + "; ".join(parts))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage-s", type=float, default=25.0, help="seconds per stage")
    p.add_argument("--slow-factor", type=float, default=20.0)
    p.add_argument("--workers", type=int, default=12)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "operations-board.png")
    args = p.parse_args(argv)
    run(args.stage_s, args.slow_factor, args.out, args.workers)


if __name__ == "__main__":
    main()
