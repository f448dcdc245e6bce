"""Interference: what the other classes cost realtime's first token, with realtime alone as the
floor. For each case, ``qos`` runs the scenario's workload twice on the same fleet: mixed (every
class, as drawn) and alone (the very same realtime requests, same arrival times and lengths, the
other classes' requests left out), plus one ``fifo`` run of the mixed workload for throughput.

    .venv/bin/python bench/interference.py [--cases seed-2,seed-3,azure-2,azure-3]
        [--holds off,on] [--prefill-budget TOKENS|off] [--diagnose]

Cases: ``seed-L`` is ``seed-classes`` at ``--load L``; ``azure-T`` is ``azure-conv`` at
``--time-scale T``; each runs with ``fleet.strict_prompt_hold`` off and on (``--holds``).
Printed per case: realtime requests in each run (they must be equal), realtime
TTFT p99 mixed, alone and their ratio (the interference), realtime SLO attainment mixed, alone
and the difference, and output tokens/s of the mixed ``qos`` run with its share of ``fifo``'s.
Deterministic: the workload is seeded, so the same command prints the same table.

``--diagnose`` adds, per run, where realtime's TTFT goes for its slowest 2% (mean ms): waiting
in qosgate for a dispatch, in the engine before its first prefill chunk, and in its prefill
(from its first chunk to its first token), with the prefill tokens of other classes that shared
those steps and the mean decode batch.

Request data: Azure LLM inference trace 2023 (conversation), Azure/AzurePublicDataset, CC-BY
4.0; Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting",
ISCA 2024.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field, replace
from typing import Any

from qosgate.config import Fleet
from qosgate.models.simmodel import SimEngine
from qosgate.sim import driver
from qosgate.sim.metrics import analyze
from qosgate.sim.results import RunResult
from qosgate.sim.scenario_file import load_scenario, override
from qosgate.sim.scenarios import Prepared, prepare, setup_for, workload_for
from qosgate.sim.workload import Workload

DEFAULT_CASES = "seed-2,seed-3,azure-2,azure-3"
DEFAULT_BUDGET = Fleet.model_fields["prefill_budget_tokens"].default
STRICT = "realtime"


def _case(name: str) -> tuple[str, dict[str, Any]]:
    kind, _, value = name.partition("-")
    if kind == "seed":
        return "seed-classes", {"arrivals": {"load": float(value)}}
    if kind == "azure":
        return "azure-conv", {"arrivals": {"time_scale": float(value)}}
    raise SystemExit(f"unknown case {name!r} (seed-L, azure-T)")


def prepared(case: str, budget: int | None, hold: bool = False) -> Prepared:
    scenario_name, changes = _case(case)
    base = load_scenario(scenario_name)
    config = dict(base.config)
    config["fleet"] = {**dict(config.get("fleet", {})), "prefill_budget_tokens": budget,
                       "strict_prompt_hold": hold}
    return prepare(override(base, config=config, sweep=None, **changes))


def alone(wl: Workload) -> Workload:
    """The same workload with only realtime's requests: same ids, times and lengths."""
    keep = {i for i, s in enumerate(wl.streams) if s.qos_class == STRICT}
    return replace(wl, arrivals=tuple(a for a in wl.arrivals if a.stream in keep))


# ------------------------------------------------------------------------------ diagnosis
@dataclass(slots=True)
class _Trace:
    """What the diagnosis watched: each realtime request's dispatch, the engine and start of the
    step of its first prefill chunk, and every engine's steps: (start, duration, other classes'
    prefill tokens, realtime's prefill tokens, decodes, steps; a closed-form stretch of pure
    decode steps is one row)."""

    dispatched: dict[str, float] = field(default_factory=dict)
    first_chunk: dict[str, tuple[int, float]] = field(default_factory=dict)
    steps: dict[int, list[tuple[float, float, int, int, int, int, int, float]]] = field(
        default_factory=dict)
    strict_ids: set[str] = field(default_factory=set)


def _instrument(tr: _Trace) -> tuple[Any, ...]:
    """Wrap the simulated engine and the driver (this process only) to fill ``tr``: nothing the
    simulation decides changes, it is only watched."""
    orig_advance, orig_step, orig_coalesce = (
        SimEngine.advance, SimEngine._step, SimEngine._coalesce)
    orig_dispatch = driver.Simulation._dispatch

    def advance(self: SimEngine, until: float, now: float, **kw: Any) -> Any:
        self._diag_now = now  # type: ignore[attr-defined]
        return orig_advance(self, until, now, **kw)

    def coalesce(self: SimEngine, horizon: float, out: Any) -> int:
        before = out.now
        n = len(self._running)
        k = orig_coalesce(self, horizon, out)
        if k:
            tr.steps.setdefault(id(self), []).append(
                (self._diag_now, out.now - before, 0, 0, n, k,  # type: ignore[attr-defined]
                 sum(1 for s in self._running.values() if s.id not in tr.strict_ids),
                 out.now - before - k * self.profile.step_fixed_s))
            self._diag_now += out.now - before  # type: ignore[attr-defined]
        return k

    def step(self: SimEngine, res: Any, emit_all: bool) -> Any:
        start = self._diag_now  # type: ignore[attr-defined]
        prefilling: dict[str, int] = {}
        n_dec = n_other_dec = 0
        orig_schedule = self._schedule

        def schedule(evicted: Any) -> Any:
            nonlocal n_dec, n_other_dec
            sched = orig_schedule(evicted)
            for s, k in sched.items():  # (before the step computes: decodes still look so)
                if s.is_decoding():
                    n_dec += 1
                    n_other_dec += s.id not in tr.strict_ids
                else:
                    prefilling[s.id] = k
            return sched

        self._schedule = schedule  # type: ignore[method-assign]
        try:
            ran = orig_step(self, res, emit_all)
        finally:
            del self._schedule
        self._diag_now = start + res.duration_s  # type: ignore[attr-defined]
        if prefilling or n_dec:
            strict = sum(k for rid, k in prefilling.items() if rid in tr.strict_ids)
            other = sum(prefilling.values()) - strict
            tr.steps.setdefault(id(self), []).append(
                (start, res.duration_s, other, strict, n_dec, 1, n_other_dec,
                 res.duration_s - self.profile.step_fixed_s
                 - self.profile.prefill_s_per_token * (other + strict)))
            for rid in prefilling:
                if rid in tr.strict_ids:
                    tr.first_chunk.setdefault(rid, (id(self), start))
        return ran

    def dispatch(self: Any, d: Any, now: float) -> Any:
        if d.req.service_class == STRICT and not d.resume:
            tr.strict_ids.add(d.req.id)
            tr.dispatched.setdefault(d.req.id, now)
        return orig_dispatch(self, d, now)

    SimEngine.advance = advance  # type: ignore[method-assign]
    SimEngine._coalesce = coalesce  # type: ignore[method-assign]
    SimEngine._step = step  # type: ignore[method-assign]
    driver.Simulation._dispatch = dispatch  # type: ignore[method-assign]
    return orig_advance, orig_step, orig_coalesce, orig_dispatch


def _uninstrument(saved: tuple[Any, ...]) -> None:
    (SimEngine.advance, SimEngine._step, SimEngine._coalesce,  # type: ignore[method-assign]
     driver.Simulation._dispatch) = saved  # type: ignore[method-assign]


def _breakdown(result: RunResult, tr: _Trace) -> str:
    """Means over the realtime requests with the slowest 2% of TTFTs."""
    import bisect

    starts = {e: [row[0] for row in rows] for e, rows in tr.steps.items()}
    rows = []
    for r in result.records:
        if r.service_class != STRICT or r.first_token_at is None or r.rid not in tr.first_chunk:
            continue
        eng, c = tr.first_chunk[r.rid]
        d = tr.dispatched.get(r.rid, r.arrival)
        log, st = tr.steps[eng], starts[eng]
        # steps between its dispatch and its first chunk, and those of its prefill
        i0 = bisect.bisect_right(st, d) - 1
        i1 = bisect.bisect_left(st, c)
        i2 = bisect.bisect_left(st, r.first_token_at)
        queued = log[max(i0, 0):i1]
        pre = log[i1:i2]
        q_steps = sum(x[5] for x in queued)
        p_steps = max(1, sum(x[5] for x in pre))
        rows.append((
            r.first_token_at - r.arrival, d - r.arrival, c - d, r.first_token_at - c,
            q_steps, sum(x[2] for x in queued) / max(1, q_steps),
            sum(x[3] for x in queued) / max(1, q_steps),
            p_steps, sum(x[2] for x in pre) / p_steps, sum(x[3] for x in pre) / p_steps,
            sum(x[4] * x[5] for x in pre) / p_steps, r.prompt_tokens,
            sum(x[6] * x[5] for x in pre) / p_steps,
            sum(x[7] for x in queued + pre) / max(1, q_steps + p_steps),
            sum(x[1] for x in queued + pre) / max(1, q_steps + p_steps)))
    rows.sort()
    tail = rows[-max(1, len(rows) // 50):]

    def m(i: int) -> float:
        return sum(row[i] for row in tail) / len(tail)

    return (f"slowest {len(tail)}: ttft {1000 * m(0):.0f} = qosgate {1000 * m(1):.0f} + engine "
            f"queue {1000 * m(2):.0f} ({m(4):.1f} steps: others' prefill {m(5):.0f}, rt "
            f"{m(6):.0f} tok/step) + prefill {1000 * m(3):.0f} ms ({m(7):.1f} steps: own "
            f"prompt {m(11):.0f} tok, others' prefill {m(8):.0f}, rt {m(9):.0f} tok/step, "
            f"decodes {m(10):.0f} ({m(12):.0f} others')/step); mean step {1000 * m(14):.0f} "
            f"ms of which decodes {1000 * m(13):.0f} ms")


# ------------------------------------------------------------------------------ runs
def run(prep: Prepared, wl: Workload, policy: str,
        diagnose: bool = False) -> tuple[dict[str, Any], str]:
    tr = _Trace()
    saved = _instrument(tr) if diagnose else None
    try:
        result = driver.run_policy(setup_for(prep, wl), policy)
    finally:
        if saved is not None:
            _uninstrument(saved)
    cfg = prep.cfg
    m = analyze(result, prep.slos, lambda t: "-", cfg.fairness.prompt_weight,
                cfg.fairness.output_weight, lambda t: 1.0)
    rt = m["classes"][STRICT]
    out = {"n": rt["count"], "ttft": rt["ttft_p99_ms"], "slo": rt["slo_attainment"],
           "tok_s": m["totals"]["output_tok_s"],
           "prompts": sorted(r.prompt_tokens for r in result.records
                             if r.service_class == STRICT)}
    return out, _breakdown(result, tr) if diagnose else ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=DEFAULT_CASES)
    ap.add_argument("--holds", default="off,on", help="fleet.strict_prompt_hold: off, on")
    ap.add_argument("--prefill-budget", default="default",
                    help=f"token count, off, or default ({DEFAULT_BUDGET})")
    ap.add_argument("--diagnose", action="store_true")
    args = ap.parse_args()
    pb = args.prefill_budget
    budget = DEFAULT_BUDGET if pb == "default" else None if pb == "off" else int(pb)
    holds = [h == "on" for h in args.holds.split(",")]
    print(f"{'case':<9} {'hold':>4} {'rt n':>6} {'TTFT p99 mixed':>14} {'alone':>7} {'ratio':>5} "
          f"{'SLO mixed':>9} {'alone':>6} {'diff':>6} {'out tok/s':>9} {'% fifo':>6} "
          f"{'wall':>5}")
    for case, hold in ((c, h) for c in args.cases.split(",") for h in holds):
        t0 = time.perf_counter()
        prep = prepared(case, budget, hold)
        wl = workload_for(prep)
        fifo, _ = run(prep, wl, "fifo")
        mixed, why_mixed = run(prep, wl, "qos", args.diagnose)
        solo, why_solo = run(prep, alone(wl), "qos", args.diagnose)
        if mixed["n"] != solo["n"] or mixed["prompts"] != solo["prompts"]:
            raise SystemExit(f"{case}: the realtime requests differ between the runs")
        print(f"{case:<9} {'on' if hold else 'off':>4} {mixed['n']:>6} "
              f"{mixed['ttft']:>12.0f}ms {solo['ttft']:>5.0f}ms "
              f"{mixed['ttft'] / solo['ttft']:>5.2f} {100 * mixed['slo']:>8.1f}% "
              f"{100 * solo['slo']:>5.1f}% {100 * (mixed['slo'] - solo['slo']):>+6.1f} "
              f"{mixed['tok_s']:>9.0f} {100 * mixed['tok_s'] / fifo['tok_s']:>5.1f}% "
              f"{time.perf_counter() - t0:>4.0f}s", flush=True)
        if args.diagnose:
            print(f"  mixed: {why_mixed}\n  alone: {why_solo}", flush=True)


if __name__ == "__main__":
    main()
