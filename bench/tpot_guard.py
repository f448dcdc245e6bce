"""What protects realtime's time per token in the simulator: ``qos`` with the TPOT guard
(``fleet.tpot_guard``) off, learned (``auto``) and at fixed fractions of realtime's TPOT budget,
under one or more prefill budgets (``fleet.prefill_budget_tokens``), on the workloads the
issue-9 goals are judged on.

    .venv/bin/python bench/tpot_guard.py [--guards off,auto,0.6,0.9] [--cases seed-1,seed-5,...]
        [--prefill-budgets default,768,off] [--prompt-hold off|on]

Cases: ``seed-L`` is ``seed-classes`` at ``--load L``; ``azure-T`` is ``azure-conv`` at
``--time-scale T``; ``mixed`` is ``fleet-mixed`` (heterogeneous replicas, its own 1.5x) and
``mixed-adaptive`` the same with ``--window-mode adaptive``; ``faults`` is ``fleet-faults``
(three replicas: one fails and comes back, one slows to 3x); ``rtalone-L`` is ``seed-classes``'
realtime stream alone, at the rate it has in ``seed-L`` (the other classes left out): the floor
under realtime's latency at that load, whatever qosgate does with the others.
Every run is one ``qosgate simulate --policies qos`` of that scenario with
``config.fleet.tpot_guard``, ``prefill_budget_tokens`` and ``strict_prompt_hold``
(``--prompt-hold``, off by default) set (merged into the scenario's own config),
deterministic: the same command prints the same table. Printed per run: realtime TTFT p99 /
TPOT p99 / SLO attainment (TTFT and TPOT), api's SLO attainment, refusals at arrival and queue
timeouts (all classes), goodput (requests that met both SLOs and finished inside the
arrival span, per second of it), output tokens/s and their share of ``fifo``'s (one ``fifo``
run per case, first, with the default prefill budget, which ``fifo`` ignores), and the engines'
KV evictions.

Request data: Azure LLM inference trace 2023 (conversation), Azure/AzurePublicDataset, CC-BY
4.0; Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting",
ISCA 2024.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from qosgate.config import Fleet
from qosgate.sim.scenario_file import load_scenario, override
from qosgate.sim.scenarios import prepare, run_scenario

DEFAULT_CASES = "seed-0.5,seed-1,seed-3,seed-5,azure-3,mixed,faults"
DEFAULT_BUDGET = Fleet.model_fields["prefill_budget_tokens"].default


def _case(name: str) -> tuple[str, dict[str, Any]]:
    if name == "mixed":
        return "fleet-mixed", {}
    if name == "mixed-adaptive":
        return "fleet-mixed", {"window_mode": "adaptive"}
    if name == "faults":
        return "fleet-faults", {}
    kind, _, value = name.partition("-")
    if kind == "seed":
        return "seed-classes", {"arrivals": {"load": float(value)}}
    if kind == "rtalone":
        mix = load_scenario("seed-classes").mix
        share = sum(m.share for m in mix if m.qos_class == "realtime") / sum(m.share for m in mix)
        return "seed-classes", {"arrivals": {"load": float(value) * share},
                                "mix": [{"share": 1, "class": "realtime"}]}
    if kind == "azure":
        return "azure-conv", {"arrivals": {"time_scale": float(value)}}
    raise SystemExit(
        f"unknown case {name!r} (seed-L, rtalone-L, azure-T, mixed, mixed-adaptive, faults)")


def run(case: str, guard: float | str | None, policy: str = "qos",
        budget: int | None = DEFAULT_BUDGET, hold: bool = False) -> dict[str, Any]:
    scenario_name, changes = _case(case)
    base = load_scenario(scenario_name)
    config = dict(base.config)
    config["fleet"] = {**dict(config.get("fleet", {})), "tpot_guard": guard,
                       "prefill_budget_tokens": budget, "strict_prompt_hold": hold}
    scenario = override(base, policies=[policy], config=config, sweep=None, **changes)
    result = run_scenario(prepare(scenario))
    (one,) = result.runs
    m = one.metrics
    rt, api, tot = m["classes"]["realtime"], m["classes"].get("api", {}), m["totals"]
    evictions = sum(r.get("kv_evictions") or 0 for r in m["replicas"].values())
    return {
        "rt_ttft_p99": rt["ttft_p99_ms"], "rt_tpot_p99": rt["tpot_p99_ms"],
        "rt_slo": rt["slo_attainment"], "api_slo": api.get("slo_attainment"),
        "goodput": tot["goodput_rps"], "tok_s": tot["output_tok_s"], "evict": evictions,
        "rej": tot["rejected"], "t_o": tot["timed_out"],
    }


def _budget(text: str) -> int | None:
    return DEFAULT_BUDGET if text == "default" else None if text == "off" else int(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--guards", default="off,auto,0.6,0.9")
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--prefill-budgets", default="default",
                    help=f"token counts, off, or default ({DEFAULT_BUDGET})")
    ap.add_argument("--prompt-hold", choices=("off", "on"), default="off",
                    help="fleet.strict_prompt_hold for the qos runs")
    args = ap.parse_args()
    hold = args.prompt_hold == "on"
    guards: list[float | str | None] = [
        None if g == "off" else g if g == "auto" else float(g) for g in args.guards.split(",")]
    budgets = [_budget(b) for b in args.prefill_budgets.split(",")]
    print(f"{'case':<14} {'budget':>6} {'guard':>5} {'rt TTFT p99':>11} {'rt TPOT p99':>11} "
          f"{'rt SLO':>7} {'api SLO':>7} {'rej':>5} {'t/o':>4} {'goodput/s':>9} "
          f"{'out tok/s':>9} {'% fifo':>6} {'KV evict':>8} {'wall':>6}")
    for case in args.cases.split(","):
        fifo_tok_s = 0.0
        runs = [("fifo", None, DEFAULT_BUDGET)] + [
            ("qos", g, b) for b in budgets for g in guards]
        for policy, g, b in runs:
            t0 = time.perf_counter()
            r = run(case, g, policy, b, hold)
            if policy == "fifo":
                fifo_tok_s = r["tok_s"]
            api = "-" if r["api_slo"] is None else f"{100 * r['api_slo']:.1f}%"
            label = "fifo" if policy == "fifo" else "off" if g is None else str(g)
            budget = "-" if policy == "fifo" else "off" if b is None else str(b)
            share = f"{100 * r['tok_s'] / fifo_tok_s:.1f}%" if fifo_tok_s else "-"
            print(f"{case:<14} {budget:>6} {label:>5} {r['rt_ttft_p99']:>9.0f}ms "
                  f"{r['rt_tpot_p99']:>9.0f}ms {100 * r['rt_slo']:>6.1f}% {api:>7} {r['rej']:>5} "
                  f"{r['t_o']:>4} "
                  f"{r['goodput']:>9.2f} {r['tok_s']:>9.0f} {share:>6} {r['evict']:>8} "
                  f"{time.perf_counter() - t0:>5.0f}s", flush=True)


if __name__ == "__main__":
    main()
