"""Model weight in the simulator: a heavy model (10x the step time) and a light one on one fleet
(the ``models-heavy-light`` scenario), fair share in engine time, and the light model's
realtime latency beside a flood on the heavy one.

    .venv/bin/python bench/models_sim.py [--rate 8] [--duration 120] [--flood-rate 8]

Part 1, fairness: t-heavy and t-light (one per model, class api) offer equal tokens on
replicas that serve both models. Each tenant's engine time (its requests' share of every step,
over the arrival window after the warm-up), its share of the class's, and Jain's index over
the tenants in engine time and in tokens (the simulator's token fairness, service over max-min
fair share), **without** model weight (``models:`` empty: a token costs the same on either
model), **with** the weights the two models' profiles give, and, for reference, on isolated
pools (one replica per model) without weights.

Part 2, isolation: t-light sends realtime requests to the light model while t-heavy floods the
heavy model with batch requests; the light model's realtime TTFT p50/p99 and SLO attainment on
(a) shared replicas (every replica serves both models) and (b) isolated pools (the heavy model
on its own replicas, the light one on its own; the same replica count). Model weights on.

A variant is one line of ``FAIRNESS`` or ``ISOLATION``: a name and the scenario fields it
overrides (``override`` in ``qosgate.sim.scenario_file``).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

from qosgate.sim.scenario_file import (
    Scenario,
    describe,
    load_scenario,
    override,
    scenario_from_mapping,
)
from qosgate.sim.scenarios import prepare, run_scenario

SCENARIO = "models-heavy-light"
BOTH = ("heavy", "light")


def _no_weights(s: Scenario) -> dict[str, Any]:
    return {"config": {**s.config, "models": []}}


def _replicas(*groups: tuple[int, tuple[str, ...]]) -> dict[str, Any]:
    """The fleet as groups of (count, the models they serve)."""
    return {"replicas": [{"count": n, "models": list(models)} for n, models in groups]}


def _learned(s: Scenario) -> dict[str, Any]:
    """The heavy model's weight learned from the engines' time per model (``weight: auto``)."""
    return {"config": {**s.config, "models": [{"name": "light"},
                                               {"name": "heavy", "weight": "auto"}]}}


FAIRNESS: dict[str, Any] = {
    "without model weight": _no_weights,
    "with model weight": lambda s: {},
    "learned weight (auto)": _learned,
    "isolated, no weight": lambda s: {**_no_weights(s), **_replicas((1, ("heavy",)),
                                                                    (1, ("light",)))},
}
ISOLATION: dict[str, Any] = {
    "shared (every replica both)": lambda s: _replicas((2, BOTH)),
    "isolated (1 heavy, 1 light)": lambda s: _replicas((1, ("heavy",)), (1, ("light",))),
}


def _variant(base: Scenario, changes: dict[str, Any]) -> Scenario:
    """``base`` with top-level fields replaced (its replicas list too, which ``override``
    keeps as the scenario lists it)."""
    return scenario_from_mapping({**base.model_dump(by_alias=True), **changes}, base.name)


def _runs(base: Scenario, variants: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each variant of ``base`` run: its name and its metrics."""
    for name, change in variants.items():
        (run,) = run_scenario(prepare(_variant(base, change(base)))).runs
        yield name, run.metrics


def fairness(base: Scenario) -> None:
    print(f"part 1: fair share between t-heavy and t-light (class api): {describe(base)}")
    print(f"{'variant':<24} {'tenant':<8} {'engine s':>9} {'prefill':>8} {'decode':>8} "
          f"{'share':>6} {'tok cost':>9} {'Jain eng':>9} {'Jain tok':>9}")
    for name, m in _runs(base, FAIRNESS):
        eng = m["engine_time"]["api"]
        tok = m["fairness"]["api"]
        for i, (tenant, t) in enumerate(eng["tenants"].items()):
            served = tok["tenants"][tenant]["service"]
            last = i == len(eng["tenants"]) - 1
            jains = (f"{eng['jain']:>9.3f} {tok['jain']:>9.3f}" if last else "")
            print(f"{name if i == 0 else '':<24} {tenant:<8} {t['engine_s']:>9.1f} "
                  f"{t['prefill_s']:>8.1f} {t['decode_s']:>8.1f} {t['share']:>6.1%} "
                  f"{served:>9.0f} {jains}")


def isolation(base: Scenario, flood_rate: float, light_rate: float) -> None:
    mix = [
        {"share": light_rate, "class": "realtime", "tenant": "t-light", "model": "light"},
        {"share": flood_rate, "class": "batch", "tenant": "t-heavy", "model": "heavy"},
    ]
    s = override(base, mix=mix, arrivals={"rate": light_rate + flood_rate})
    print(f"\npart 2: t-light realtime at {light_rate:g} req/s on the light model, t-heavy "
          f"floods the heavy model with batch at {flood_rate:g} req/s")
    print(f"{'variant':<30} {'n':>5} {'refused':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'SLO':>7} {'heavy tok/s':>12}")
    for name, m in _runs(s, ISOLATION):
        rt = m["classes"]["realtime"]
        heavy = m["classes"]["batch"]
        print(f"{name:<30} {rt['count']:>5} {rt['rejected']:>8} {rt['ttft_p50_ms']:>7.0f}ms "
              f"{rt['ttft_p99_ms']:>7.0f}ms {rt['tpot_p50_ms']:>7.0f}ms "
              f"{rt['slo_attainment']:>7.1%} {heavy['output_tok_s']:>12.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=None,
                    help="part 1's requests/s, both tenants (default: the scenario's)")
    ap.add_argument("--duration", type=float, default=None, help="seconds of arrivals")
    ap.add_argument("--flood-rate", type=float, default=4.0, help="part 2: heavy batch req/s")
    ap.add_argument("--light-rate", type=float, default=2.0, help="part 2: light realtime req/s")
    ap.add_argument("--scenario", default=SCENARIO,
                    help="a scenario of the same shape (name or path; default: %(default)s)")
    args = ap.parse_args()
    base = load_scenario(args.scenario)
    if args.rate is not None:
        base = override(base, arrivals={"rate": args.rate})
    if args.duration is not None:
        base = override(base, duration_s=args.duration)
    fairness(base)
    isolation(base, args.flood_rate, args.light_rate)


if __name__ == "__main__":
    main()
