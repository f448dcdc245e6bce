"""Goodput per class under overload, in the simulator: the `seed-classes` mix (the four default
classes on one H100, request lengths from the Azure LLM conversation trace) at several loads,
with deadline admission's quantile as configured or set; per class and all together, what was
admitted and refused, the share of admitted requests that met their TTFT budget, and goodput.

    .venv/bin/python bench/goodput_sim.py [--loads 1,3,5] [--quantiles 0.95] [--scenario NAME]

Columns: **n** requests offered; **refused** at arrival; **admitted met** the share of the
admitted (not refused) requests whose first token came within their class's TTFT budget;
**goodput/s** requests that met both SLOs (TTFT and TPOT) per second of the whole run (the
simulator's ``goodput_rps_run``: the drain after the arrival window counts); **x 1x** goodput
over that of the first load. The simulator's admission is the gateway's code (the same core).

Trace: Azure LLM inference trace 2023 (conversation), Azure/AzurePublicDataset, CC-BY 4.0;
Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024.
"""

from __future__ import annotations

import argparse
from typing import Any

from qosgate.sim.scenario_file import load_scenario, override
from qosgate.sim.scenarios import prepare, run_scenario


def run(name: str, load: float, quantile: float | None) -> dict[str, Any]:
    scenario = load_scenario(name)
    scenario = override(scenario, policies=("qos",), sweep=None, arrivals={"load": load})
    if quantile is not None:
        config = dict(scenario.config)
        config["admission"] = {**dict(config.get("admission", {})), "quantile": quantile}
        scenario = override(scenario, config=config)
    (result,) = run_scenario(prepare(scenario)).runs
    metrics: dict[str, Any] = result.metrics
    return metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--loads", default="1,3,5")
    ap.add_argument("--quantiles", default="", help="admission.quantile values, comma-"
                    "separated (default: the configuration's)")
    ap.add_argument("--scenario", default="seed-classes")
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    quantiles: list[float | None] = ([float(q) for q in args.quantiles.split(",")]
                                     if args.quantiles else [None])
    for q in quantiles:
        base: float | None = None
        print(f"{args.scenario}, admission.quantile {q if q is not None else 'as configured'}")
        print(f"{'load':>5} {'class':<9} {'n':>6} {'refused':>8} {'admitted met':>13} "
              f"{'goodput/s':>10} {'x 1x':>6}")
        for load in loads:
            m = run(args.scenario, load, q)
            rows = [*m["classes"].items(), ("all", m["totals"])]
            for cls, c in rows:
                met = c["admitted_ttft_met"]
                good = c["goodput_rps_run"] or 0.0
                ratio = ""
                if cls == "all":
                    base = good if base is None else base
                    ratio = f"{good / base:.2f}" if base else "-"
                print(f"{load:>4g}x {cls:<9} {c['count']:>6} {c['rejected']:>8} "
                      f"{'-' if met is None else f'{met:.1%}':>13} {good:>10.2f} {ratio:>6}")


if __name__ == "__main__":
    main()
