"""Simulator speed: the whole Azure LLM conversation trace 2023 (19,366 requests) under three
policies, one after another in one process; prints wall time and simulated requests per wall
second per policy and in total.

    .venv/bin/python bench/sim_speed.py [--policies fifo,priority,qos] [--time-scale 3]
                                        [--trace PATH]

Trace: Azure LLM inference trace 2023 (conversation), Azure/AzurePublicDataset, CC-BY 4.0;
Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024
(with --trace PATH, the attribution printed is that file's).
"""

from __future__ import annotations

import argparse
import platform
import time

from qosgate.sim.driver import run_policy
from qosgate.sim.metrics import percentile, ttft
from qosgate.sim.scenario_file import load_scenario, override
from qosgate.sim.scenarios import attribution, prepare, setup_for, workload_for


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="fifo,priority,qos")
    ap.add_argument("--time-scale", type=float, default=None, help="default: the scenario's (3)")
    ap.add_argument("--trace", default=None)
    args = ap.parse_args()

    t0 = time.perf_counter()
    scenario = load_scenario("azure-conv")
    if args.time_scale is not None:
        scenario = override(scenario, arrivals={"time_scale": args.time_scale})
    prep = prepare(scenario, args.trace, measure_capacity=False)
    wl = workload_for(prep)
    setup = setup_for(prep, wl)
    t_setup = time.perf_counter() - t0
    print(
        f"azure-conv: {len(wl.arrivals)} requests over {wl.duration:.0f} s virtual "
        f"(time scale {scenario.arrivals.time_scale:g}, {wl.offered_rps:.2f} req/s), "
        f"engine {prep.profile.name}, window {prep.window}; "
        f"python {platform.python_version()} on {platform.machine()}"
    )
    print(f"setup (read trace, draw classes): {t_setup:.2f} s")
    total_req = 0
    total_wall = 0.0
    for policy in args.policies.split(","):
        t = time.perf_counter()
        res = run_policy(setup, policy)
        wall = time.perf_counter() - t
        total_req += res.arrivals
        total_wall += wall
        rt = sorted(
            x for r in res.records if r.service_class == "realtime" and (x := ttft(r)) is not None
        )
        p99 = percentile(rt, 99)
        lost = res.arrivals - len(res.records)
        print(
            f"{policy:>16}: {wall:6.2f} s wall, {res.arrivals / wall:7.0f} simulated requests/s "
            f"(virtual {res.makespan:.0f} s, {res.makespan / wall:.0f}x real time; "
            f"{res.scheduler_calls} scheduler calls; realtime TTFT p99 "
            f"{'-' if p99 is None else f'{1000 * p99:.0f} ms'}; lost {lost})"
        )
    print(
        f"{'total':>16}: {total_wall:6.2f} s wall for {total_req} requests, "
        f"{total_req / total_wall:.0f} simulated requests/s"
    )
    print(f"request data: {attribution(prep)}")


if __name__ == "__main__":
    main()
