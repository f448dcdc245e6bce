"""``--compare-sim PROFILE``: the replayed workload run in the simulator with that engine
profile, and the measured figures beside the predicted ones with the relative error per class
and percentile ((predicted - measured) / measured; for SLO attainment, the difference in
points)."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from qosgate.models.simmodel import load_profile
from qosgate.sim.driver import run_policy
from qosgate.sim.fmt import ms, pct
from qosgate.sim.metrics import analyze
from qosgate.sim.scenarios import Prepared, Run, setup_for
from qosgate.sim.setup import ReplicaPlan
from qosgate.sim.workload import Workload

# (metric key, label, kind): what is compared, per class
FIGURES: tuple[tuple[str, str, str], ...] = (
    ("ttft_p50_ms", "TTFT p50", "ms"), ("ttft_p90_ms", "TTFT p90", "ms"),
    ("ttft_p99_ms", "TTFT p99", "ms"), ("tpot_p50_ms", "TPOT p50", "ms"),
    ("tpot_p99_ms", "TPOT p99", "ms"), ("e2e_p50_ms", "E2E p50", "ms"),
    ("e2e_p99_ms", "E2E p99", "ms"), ("slo_attainment", "SLO", "pct"),
    ("rejected", "refused", "n"),
)


def predict(prep: Prepared, wl: Workload, profile: str, policy: str,
            replicas: int | None = None) -> Run:
    """Simulate ``wl`` (the replayed requests) on the scenario's fleet with every replica's
    profile replaced by ``profile`` (``replicas`` of them if given), under ``policy``."""
    prof = load_profile(profile)
    n = replicas if replicas is not None else len(prep.fleet)
    base = prep.fleet[0]
    window = base.window
    if base.profile != prof and prep.scenario.window == "auto":
        window = max(1, min(prof.max_num_seqs, int(prof.kv_capacity_tokens // prep.mean_tokens)))
    fleet = tuple(ReplicaPlan(f"r{i}", prof, window, base.pausable, base.window_mode)
                  for i in range(n))
    sim_prep = Prepared(prep.scenario, prep.cfg, prof, fleet[0].window, prep.mean_tokens,
                        prep.slos, prep.api_keys, fleet=fleet)
    result = run_policy(setup_for(sim_prep, wl), policy)
    cfg = prep.cfg
    tier = {t.name: t.tier for t in cfg.tenants}
    weight = {t.name: t.weight for t in cfg.tenants}
    metrics = analyze(result, prep.slos, lambda t: tier.get(t, "-"),
                      cfg.fairness.prompt_weight, cfg.fairness.output_weight,
                      lambda t: weight.get(t, 1.0), [s.label() for s in wl.streams],
                      prep.scenario.warmup_s)
    return Run(f"sim {policy}", None, wl.offered_rps, result, metrics)


def rel_error(measured: float | None, predicted: float | None) -> float | None:
    if measured is None or predicted is None or measured == 0:
        return None
    return (predicted - measured) / measured


def difference(measured: float | None, predicted: float | None) -> float | None:
    return None if measured is None or predicted is None else predicted - measured


def comparison(meas: Run, pred: Run) -> dict[str, Any]:
    """Per class and figure: measured, predicted, relative error (the JSON's ``compare_sim``)."""
    out: dict[str, Any] = {}
    for cls, m in [*meas.metrics["classes"].items(), ("all", meas.metrics["totals"])]:
        p = pred.metrics["totals"] if cls == "all" else pred.metrics["classes"].get(cls, {})
        out[cls] = {key: {"measured": m.get(key), "predicted": p.get(key),
                          "rel_error": rel_error(m.get(key), p.get(key)),
                          "difference": difference(m.get(key), p.get(key))}
                    for key, _, _ in FIGURES}
    return out


def _count(x: float | None) -> str:
    return "-" if x is None else str(x)


def compare_table(cmp: dict[str, Any], profile: str) -> Table:
    """One row per class and figure: measured, predicted, relative error."""
    t = Table(title=f"measured vs simulated ({profile})", title_justify="left")
    for col in ("class", "figure", "measured", "predicted", "error"):
        t.add_column(col, justify="left" if col in ("class", "figure") else "right")
    for cls, figs in cmp.items():
        for i, (key, label, kind) in enumerate(FIGURES):
            f = figs[key]
            if kind == "ms":
                fmt, err = ms, f["rel_error"]
                shown = "-" if err is None else f"{100 * err:+.0f}%"
            elif kind == "pct":  # an attainment: the difference in points
                fmt, err = pct, f["difference"]
                shown = "-" if err is None else f"{100 * err:+.1f} pt"
            else:  # a count: the difference
                fmt, err = _count, f["difference"]
                shown = "-" if err is None else f"{err:+d}"
            t.add_row(cls if i == 0 else "", label, fmt(f["measured"]), fmt(f["predicted"]),
                      shown, end_section=i == len(FIGURES) - 1)
    return t
