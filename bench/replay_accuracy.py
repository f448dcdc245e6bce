"""How far the calibrated simulator's predictions are from a measured replay, per class.

    .venv/bin/python bench/replay_accuracy.py [--replicas 3] [--loads 1,2] [--duration 60]
        [--time-scale 8] [--window 64] [--scenario seed-classes]

A benchmark, not a test: it prints what happened. On fresh processes:

1. ``--replicas`` stand-ins (the default profile, ``--time-scale`` slower than modelled so the
   box's two cores keep up with the token streams; vLLM's ``priority`` scheduling);
2. ``qosgate calibrate`` on the first stand-in (given its batch and KV sizes): the fitted
   profile is all the simulator knows of the engines; then one gateway in front of them (the
   default config, each upstream's ``capacity`` ``--window``);
3. for each load in ``--loads``: ``qosgate replay`` of the scenario through the gateway at that
   load (relative to the calibrated fleet's modelled capacity), with ``--compare-sim`` of the
   calibrated profile; its tables are printed as the command prints them;
4. a summary per load: each class's TTFT and TPOT p50 error against the goal (``--goal``), and
   the p99 and SLO-attainment errors beside them.

The commands are printed before they run, so each step can be run by hand on any fleet.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the one server-process wrapper lives with the tests

from qosgate.models.simmodel import load_profile  # noqa: E402
from tests.support.processes import QOSGATE, Server, start_gateway, start_standin  # noqa: E402


def run(cmd: list[str]) -> None:
    shown = " ".join(["qosgate", *cmd[len(QOSGATE):]])
    print(f"$ {shown}", flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, check=True)
    print(f"({time.monotonic() - t0:.0f} s)\n", flush=True)


def gateway(tmp: Path, urls: list[str], window: int) -> Server:
    cfg = {"upstreams": [{"url": u, "name": f"r{i}", "max_window": window}
                         for i, u in enumerate(urls)]}
    path = tmp / "gateway.json"
    path.write_text(json.dumps(cfg, indent=1))
    return start_gateway(tmp, "--config", str(path))


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.0f}%"


def summary(doc: dict[str, Any], goal: float) -> list[str]:
    """Per class: the p50 errors against the goal, the p99 and SLO errors beside them."""
    lines = [f"{'class':9} {'TTFT p50':>9} {'TPOT p50':>9} {'TTFT p99':>9} {'TPOT p99':>9} "
             f"{'E2E p50':>8} {'SLO':>8}  p50s within {100 * goal:.0f}%"]
    for cls, figs in doc["compare_sim"]["classes"].items():
        errs = [figs[k]["rel_error"] for k in ("ttft_p50_ms", "tpot_p50_ms")]
        ok = all(e is not None and abs(e) <= goal for e in errs)
        slo = figs["slo_attainment"]
        slo_pt = (None if slo["measured"] is None or slo["predicted"] is None
                  else 100 * (slo["predicted"] - slo["measured"]))
        lines.append(
            f"{cls:9} {pct(errs[0]):>9} {pct(errs[1]):>9} "
            f"{pct(figs['ttft_p99_ms']['rel_error']):>9} "
            f"{pct(figs['tpot_p99_ms']['rel_error']):>9} "
            f"{pct(figs['e2e_p50_ms']['rel_error']):>8} "
            f"{'-' if slo_pt is None else f'{slo_pt:+.1f}pt':>8}  {'yes' if ok else 'NO'}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--loads", default="1,2")
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--time-scale", type=float, default=8.0)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--scenario", default="seed-classes")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--goal", type=float, default=0.20)
    ap.add_argument("--max-seconds", type=float, default=600.0)
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",") if x.strip()]
    with tempfile.TemporaryDirectory(prefix="qosgate-replay-acc-") as d:
        tmp = Path(d)
        servers: list[Server] = []
        try:
            for _ in range(args.replicas):
                servers.append(start_standin(tmp, "--scheduling-policy", "priority",
                                             "--time-scale", str(args.time_scale)))
            print(f"{args.replicas} stand-ins (default profile, --time-scale "
                  f"{args.time_scale:g}) behind one gateway (capacity {args.window} each)\n")
            prof = tmp / "calibrated.yaml"
            # vLLM publishes its KV size (cache_config_info), never max_num_seqs: a user gives
            # both from the engine's flags, as here from the stand-in's profile
            engine = load_profile("default")
            run([*QOSGATE, "calibrate", servers[0].url, "--out", str(prof),
                 "--max-num-seqs", str(engine.max_num_seqs),
                 "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
                 "--kv-capacity-tokens", str(int(engine.kv_capacity_tokens))])
            # the gateway starts after the probe: it learns the replicas from the replay alone
            gw = gateway(tmp, [s.url for s in servers], args.window)
            servers.append(gw)
            docs = {}
            for load in loads:
                out = tmp / f"replay-{load:g}.json"
                run([*QOSGATE, "replay", gw.url, "--scenario", args.scenario,
                     "--seed", str(args.seed), "--profile", str(prof), "--replicas",
                     str(args.replicas), "--window", str(args.window), "--load", f"{load:g}",
                     "--duration", f"{args.duration:g}", "--max-seconds",
                     f"{args.max_seconds:g}", "--compare-sim", str(prof), "--out", str(out)])
                docs[load] = json.loads(out.read_text())
            for load, doc in docs.items():
                print(f"errors at {load:g}x, (predicted - measured) / measured; SLO in points:")
                print("\n".join(summary(doc, args.goal)))
                print()
        finally:
            for s in servers:
                s.stop()


if __name__ == "__main__":
    main()
