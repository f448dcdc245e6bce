"""Metrics of a simulated run: latency percentiles, SLO attainment, goodput, throughput, fairness.

Definitions (times from the client's side, in virtual seconds; ``D`` = the arrival span):

- TTFT = first token - arrival (queueing included); E2E = finish - arrival; TPOT = (finish - first
  token) / (output tokens - 1), over requests with at least 2 output tokens (vLLM's benchmark
  definition). A paused-and-resumed request's pause counts in its TPOT and E2E. Percentiles are
  over *completed* requests, by linear interpolation between closest ranks (numpy's default,
  Hyndman & Fan type 7): the p-th percentile of sorted x_0..x_{n-1} is at rank h = (n-1)p/100.
- SLO: a request meets its class's SLO when it *completed* with TTFT <= the TTFT SLO and TPOT <=
  the TPOT SLO (a request with one output token has no TPOT and meets that half). SLO attainment =
  requests meeting it / *all* requests of the group: rejected and timed-out requests count against
  it, as refusing work is not serving it.
- Goodput = requests that met their SLO (both TTFT and TPOT: DistServe, OSDI'24) *and finished
  inside the arrival span* [0, D], per second of it; completed/s likewise (requests completed by
  D, / D). Only what finishes inside the arrival span counts: a request completed while the
  backlog drains after D is not credited to it (dividing every completion by D would report more
  than the engine can do under overload). ``goodput_rps_run`` and ``completed_rps_run`` are the
  whole-run figures: every request that met its SLO (or completed), over the whole run [0, end of
  the last request] -- the arrival span plus the drain.
- Output tokens/s = output tokens generated during the arrival span [0, D] / D: tokens of
  requests that finished by D plus, for those still running at D, the tokens generated so far
  (to within the engine step running at D). Measuring over the arrival span, not until the last
  backlogged request drains, gives the sustained throughput under the offered load.
- Fairness between the tenants of one class, over [W, D] where W is the scenario's ``warmup_s``
  (while the windows fill nobody waits, so there is nothing to be fair about yet). A tenant's
  demand is the VTC cost (the scheduler's own measure of service: prompt_weight x prompt tokens +
  output_weight x output tokens, 1 and 2 by default) of its requests that wanted service in
  [W, D]: those that arrived in it, and those still waiting for their first token at W. Its
  service is the cost of its requests *granted* service in [W, D], i.e. whose first token came
  in it (continuous batching then serves all running requests at the same token rate, so
  who gets started is what the scheduler decides; counting tokens only as they are generated
  would make a fair schedule look unfair by the requests still decoding at D). The fair outcome
  with unequal demand is weighted max-min fairness: water-filling the class's granted service C,
  tenants asking less than the fair level get their whole demand and the others share the rest
  by weight (a flooding tenant gets what the others leave). Jain's index (Jain, Chiu & Hawe 1984)
  is taken over each tenant's service relative to its max-min fair share, J = (sum r_i)^2 /
  (n sum r_i^2) with r_i = x_i / f_i: 1 when every tenant gets exactly its fair share, 1/n when
  one tenant gets all. The service gap is max r_i - min r_i (0 = fair; 0.5 = one tenant got half
  its fair share less than another). ``jain_raw``, over service per weight without regard to
  demand, is kept for reference.

Why one module over 500 lines: it is one job (a run's records in, its numbers out), and a third
of it is this docstring -- the definitions every figure in the report rests on, kept beside the
code that computes them.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from qosgate.sim.results import RequestRecord, RunResult

PERCENTILES = (50, 90, 99)
OUTCOMES = ("completed", "rejected", "timed_out", "cancelled", "failed")


@dataclass(slots=True, frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


def percentile(sorted_xs: Sequence[float], p: float) -> float | None:
    """Linear interpolation between closest ranks (type 7); ``sorted_xs`` must be sorted."""
    n = len(sorted_xs)
    if n == 0:
        return None
    if not 0 <= p <= 100:
        raise ValueError("p must be in [0, 100]")
    h = (n - 1) * p / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, n - 1)
    return sorted_xs[lo] + (h - lo) * (sorted_xs[hi] - sorted_xs[lo])


def mean(xs: Sequence[float]) -> float | None:
    return math.fsum(xs) / len(xs) if xs else None


def jain(xs: Sequence[float]) -> float | None:
    """Jain's fairness index (sum x)^2 / (n sum x^2); None for no values or all zeros."""
    n = len(xs)
    sq = math.fsum(x * x for x in xs)
    if n == 0 or sq == 0:
        return None
    s = math.fsum(xs)
    return s * s / (n * sq)


def max_min_fair(
    demands: Sequence[float], capacity: float, weights: Sequence[float] | None = None
) -> list[float]:
    """Weighted max-min fair allocation of ``capacity`` (water-filling): a party asking less than
    its weighted share of what is left gets its whole demand; the rest share by weight."""
    n = len(demands)
    w = list(weights) if weights is not None else [1.0] * n
    if any(x <= 0 for x in w):
        raise ValueError("weights must be > 0")
    alloc = [0.0] * n
    order = sorted(range(n), key=lambda i: (demands[i] / w[i], i))
    remaining = max(0.0, capacity)
    wsum = math.fsum(w)
    for k, i in enumerate(order):
        level = remaining / wsum
        if demands[i] / w[i] <= level:
            alloc[i] = float(demands[i])
            remaining -= demands[i]
            wsum -= w[i]
        else:
            for j in order[k:]:
                alloc[j] = level * w[j]
            break
    return alloc


# ------------------------------------------------------------------------------ per request
def ttft(r: RequestRecord) -> float | None:
    return None if r.first_token_at is None else r.first_token_at - r.arrival


def e2e(r: RequestRecord) -> float:
    return r.finished_at - r.arrival


def tpot(r: RequestRecord) -> float | None:
    if r.first_token_at is None or r.output_tokens < 2:
        return None
    return (r.finished_at - r.first_token_at) / (r.output_tokens - 1)


def meets_slo(r: RequestRecord, slo: Slo) -> bool:
    if r.state != "completed" or r.first_token_at is None:
        return False
    if r.first_token_at - r.arrival > slo.ttft_s:
        return False
    t = tpot(r)
    return t is None or t <= slo.tpot_s


def _dist(prefix: str, xs: list[float]) -> dict[str, float | None]:
    xs.sort()
    out: dict[str, float | None] = {}
    for p in PERCENTILES:
        v = percentile(xs, p)
        out[f"{prefix}_p{p}_ms"] = None if v is None else v * 1000.0
    m = mean(xs)
    out[f"{prefix}_mean_ms"] = None if m is None else m * 1000.0
    return out


def group_stats(
    records: Iterable[RequestRecord],
    slo_of: Callable[[RequestRecord], Slo],
    arrival_span: float,
    span: float | None = None,
) -> dict[str, Any]:
    """Counts, latency percentiles, SLO attainment, goodput and throughput of a set of requests.
    ``arrival_span`` is D, ``span`` the whole run's length (see the module doc)."""
    recs = list(records)
    counts = dict.fromkeys(OUTCOMES, 0)
    ttfts: list[float] = []
    tpots: list[float] = []
    e2es: list[float] = []
    met = met_in = done_in = ttft_met = 0
    win_tokens = 0
    preempted = 0
    hit = hit_done = 0
    for r in recs:
        counts[r.state] = counts.get(r.state, 0) + 1
        win_tokens += r.win_output
        preempted += r.preemptions > 0
        if r.failed_attempts:
            hit += 1
            hit_done += r.state == "completed"
        if r.state == "completed":
            inside = r.finished_at <= arrival_span
            done_in += inside
            t = ttft(r)
            if t is not None:
                ttfts.append(t)
            tp = tpot(r)
            if tp is not None:
                tpots.append(tp)
            e2es.append(e2e(r))
            slo = slo_of(r)
            if t is not None and t <= slo.ttft_s:
                ttft_met += 1
            if meets_slo(r, slo):
                met += 1
                met_in += inside
    n = len(recs)
    out: dict[str, Any] = {"count": n, **counts}
    out.update(_dist("ttft", ttfts))
    out.update(_dist("tpot", tpots))
    out.update(_dist("e2e", e2es))
    out["slo_met"] = met
    out["slo_attainment"] = met / n if n else None
    admitted = n - counts.get("rejected", 0)
    out["admitted_ttft_met"] = ttft_met / admitted if admitted else None
    out["goodput_rps"] = met_in / arrival_span if arrival_span > 0 else None
    out["completed_rps"] = done_in / arrival_span if arrival_span > 0 else None
    run = span if span is not None and span > 0 else None
    out["goodput_rps_run"] = met / run if run else None
    out["completed_rps_run"] = counts["completed"] / run if run else None
    out["output_tok_s"] = win_tokens / arrival_span if arrival_span > 0 else None
    out["preempted"] = preempted
    # requests with an attempt that failed before their first token (retried, or not if their
    # attempts or the retry budget ran out), and how many of them completed after all
    out["failed_attempt"] = hit
    out["failed_attempt_completed"] = hit_done
    return out


def tenant_fairness(
    records: Iterable[RequestRecord],
    arrival_span: float,
    prompt_weight: float,
    output_weight: float,
    tenant_weight: Callable[[str], float],
    warmup: float = 0.0,
) -> dict[str, Any] | None:
    """Jain's index and service gap between the tenants of one class over [warmup, arrival_span]
    (see the module doc); None with fewer than two tenants."""
    service: dict[str, float] = {}
    demand: dict[str, float] = {}
    for r in records:
        ft = r.first_token_at
        cost = prompt_weight * r.prompt_tokens
        # wanting service during [warmup, arrival_span]: arrived in it, or alive and not started at
        # its start
        if r.arrival < arrival_span and (
            r.arrival >= warmup or (r.finished_at >= warmup and (ft is None or ft >= warmup))
        ):
            asked = cost + output_weight * r.target_output
            demand[r.tenant] = demand.get(r.tenant, 0.0) + asked
            service.setdefault(r.tenant, 0.0)
        if ft is not None and warmup <= ft <= arrival_span:
            got = cost + output_weight * r.output_tokens
            service[r.tenant] = service.get(r.tenant, 0.0) + got
    tenants = sorted(service)
    if len(tenants) < 2:
        return None
    x = [service[t] for t in tenants]
    d = [demand.get(t, 0.0) for t in tenants]
    w = [tenant_weight(t) for t in tenants]
    fair = max_min_fair(d, math.fsum(x), w)
    ratios = [xi / fi for xi, fi in zip(x, fair, strict=True) if fi > 0]
    j = jain(ratios)
    return {
        "jain": j,
        "service_gap": (max(ratios) - min(ratios)) if ratios else None,
        "jain_raw": jain([xi / wi for xi, wi in zip(x, w, strict=True)]),
        "tenants": {
            t: {
                "weight": wi,
                "demand": di,
                "service": xi,
                "fair_share": fi,
                "ratio": (xi / fi) if fi > 0 else None,
            }
            for t, wi, di, xi, fi in zip(tenants, w, d, x, fair, strict=True)
        },
    }


def queue_depth_mean(result: RunResult) -> float | None:
    """Time-average (over the samples in the arrival span) of the requests waiting for their
    first step anywhere: in qosgate's queue or in the engines' waiting queues."""
    xs = [sum(s.queued) + s.engine_waiting for s in result.samples if s.t < result.arrivals_end]
    return mean([float(x) for x in xs])


def phases(result: RunResult, slos: dict[str, Slo]) -> list[dict[str, Any]]:
    """The arrival span cut at each fault's start and end: per phase (by arrival time), what
    the fleet looked like and how its requests fared (all classes, and the most urgent one)."""
    arrival_span = result.arrivals_end
    faults = result.fleet.get("faults", [])
    assert isinstance(faults, list)
    cuts = sorted({0.0, arrival_span,
                   *(float(f["t"]) for f in faults if 0 < float(f["t"]) < arrival_span)})
    top = result.classes[0] if result.classes else ""
    out: list[dict[str, Any]] = []
    for a, b in itertools.pairwise(cuts):
        down: list[str] = []
        slow: dict[str, float] = {}
        for f in faults:
            if float(f["t"]) > a:
                break
            name = str(f["replica"])
            if f["action"] == "die":
                down.append(name)
            elif f["action"] == "revive" and name in down:
                down.remove(name)
            elif f["action"] == "slow":
                if float(f["factor"]) == 1.0:
                    slow.pop(name, None)
                else:
                    slow[name] = float(f["factor"])
        label = ", ".join(
            [f"{d} down" for d in sorted(down)]
            + [f"{k} slow x{v:g}" for k, v in sorted(slow.items())]
        ) or "all up"
        recs = [r for r in result.records if a <= r.arrival < b]
        mine = [r for r in recs if r.service_class == top]
        tt = sorted(t for r in mine if r.state == "completed" and (t := ttft(r)) is not None)
        p99 = percentile(tt, 99)
        met = sum(1 for r in mine if meets_slo(r, slos[top])) if top in slos else 0
        counts = dict.fromkeys(OUTCOMES, 0)
        for r in recs:
            counts[r.state] = counts.get(r.state, 0) + 1
        out.append(
            {
                "start_s": a,
                "end_s": b,
                "fleet": label,
                "count": len(recs),
                **counts,
                "failed_attempt": sum(1 for r in recs if r.failed_attempts),
                "top_class": top,
                "top_count": len(mine),
                "top_ttft_p99_ms": None if p99 is None else p99 * 1000.0,
                "top_slo_attainment": met / len(mine) if mine else None,
            }
        )
    return out


def replica_stats(
    result: RunResult, slo_of: Callable[[RequestRecord], Slo]
) -> dict[str, dict[str, Any]]:
    """Per replica: the requests it last served (their outcome there or after), its profile."""
    reps = result.fleet.get("replicas", [])
    assert isinstance(reps, list)
    by: dict[str, list[RequestRecord]] = {str(r["name"]): [] for r in reps}
    for r in result.records:
        if r.replica:
            by.setdefault(r.replica, []).append(r)
    info = {str(r["name"]): r for r in reps}
    names = [str(r["name"]) for r in reps]
    inside = [s for s in result.samples if s.t < result.arrivals_end and s.windows]
    out: dict[str, dict[str, Any]] = {}
    for name, rs in by.items():
        g = group_stats(rs, slo_of, result.arrivals_end, result.makespan)
        extra = info.get(name, {})
        out[name] = {
            key: extra.get(key)
            for key in ("profile", "gpu", "window", "ejections", "kv_evictions", "busy_s")
        }
        k = names.index(name) if name in names else -1
        # the core's window for it, time-averaged over the arrival span (it moves when
        # adaptive), and the most it may be
        out[name]["window_mean"] = (
            mean([float(s.windows[k]) for s in inside]) if k >= 0 and inside else None
        )
        out[name].update(g)
    return out


def analyze(
    result: RunResult,
    slos: dict[str, Slo],
    tier_of: Callable[[str], str],
    prompt_weight: float,
    output_weight: float,
    tenant_weight: Callable[[str], float],
    stream_names: Sequence[str] = (),
    warmup: float = 0.0,
) -> dict[str, Any]:
    """Everything the report shows for one run."""
    arrival_span = result.arrivals_end
    recs = result.records

    def slo_of(r: RequestRecord) -> Slo:
        return slos[r.service_class]

    by_class: dict[str, list[RequestRecord]] = {c: [] for c in result.classes}
    by_tenant: dict[str, list[RequestRecord]] = {}
    by_tier: dict[str, list[RequestRecord]] = {}
    by_stream: dict[int, list[RequestRecord]] = {}
    for r in recs:
        by_class.setdefault(r.service_class, []).append(r)
        by_tenant.setdefault(r.tenant, []).append(r)
        by_tier.setdefault(tier_of(r.tenant), []).append(r)
        by_stream.setdefault(r.stream, []).append(r)
    fairness: dict[str, Any] = {}
    for c, rs in by_class.items():
        f = tenant_fairness(rs, arrival_span, prompt_weight, output_weight, tenant_weight, warmup)
        if f is not None:
            fairness[c] = f
    span = result.makespan
    totals = group_stats(recs, slo_of, arrival_span, span)
    totals["makespan_s"] = span
    totals["queue_depth_mean"] = queue_depth_mean(result)
    return {
        "totals": totals,
        "classes": {
            c: group_stats(rs, slo_of, arrival_span, span) for c, rs in by_class.items() if rs
        },
        "tenants": {
            t: group_stats(by_tenant[t], slo_of, arrival_span, span) for t in sorted(by_tenant)
        },
        "tiers": {t: group_stats(by_tier[t], slo_of, arrival_span, span) for t in sorted(by_tier)},
        "streams": {
            (stream_names[i] if i < len(stream_names) else str(i)): group_stats(
                by_stream[i], slo_of, arrival_span, span
            )
            for i in sorted(by_stream)
        },
        "fairness": fairness,
        "replicas": replica_stats(result, slo_of),
        "phases": phases(result, slos) if result.fleet.get("faults") else [],
    }


# ------------------------------------------------------------------------------ gateways
def gateway_stats(
    result: RunResult,
    slos: dict[str, Slo],
    prompt_weight: float,
    output_weight: float,
    tenant_weight: Callable[[str], float],
    warmup: float = 0.0,
) -> list[dict[str, Any]]:
    """Per gateway instance (of ``result.gateways``): its requests, the most urgent class's TTFT
    p99 and SLO attainment, Jain's index between the tenants of each class over the requests it
    took in, and the engines' evictions of its requests' sequences."""
    arrival_span = result.arrivals_end
    top = result.classes[0] if result.classes else ""
    by: list[list[RequestRecord]] = [[] for _ in range(result.gateways)]
    for r in result.records:
        by[r.gateway].append(r)
    out: list[dict[str, Any]] = []
    for g, recs in enumerate(by):
        mine = [r for r in recs if r.service_class == top]
        tt = sorted(t for r in mine if r.state == "completed" and (t := ttft(r)) is not None)
        p99 = percentile(tt, 99)
        met = sum(1 for r in mine if top in slos and meets_slo(r, slos[top]))
        classes: dict[str, list[RequestRecord]] = {}
        for r in recs:
            classes.setdefault(r.service_class, []).append(r)
        jains: dict[str, float | None] = {}
        for c, rs in classes.items():
            f = tenant_fairness(rs, arrival_span, prompt_weight, output_weight, tenant_weight,
                                warmup)
            if f is not None:
                jains[c] = f["jain"]
        out.append(
            {
                "gateway": g,
                "count": len(recs),
                "completed": sum(1 for r in recs if r.state == "completed"),
                "rejected": sum(1 for r in recs if r.state == "rejected"),
                "top_class": top,
                "top_ttft_p99_ms": None if p99 is None else p99 * 1000.0,
                "top_slo_attainment": met / len(mine) if mine else None,
                "jain": jains,
                "engine_evictions": result.gateway_evictions[g]
                if g < len(result.gateway_evictions) else 0,
            }
        )
    return out


def limit_overshoot(result: RunResult, limits: dict[str, Any]) -> dict[str, Any]:
    """Per tenant with a requests/min limit R: what the gateways admitted (not refused at
    submission) against what the limit allows over the span of its arrivals, R + R x span / 60
    (a bucket starts full and refills R/60 per second), and how many each gateway admitted."""
    out: dict[str, Any] = {}
    for tenant, lim in sorted(limits.items()):
        rpm = getattr(lim, "requests_per_minute", None)
        if not rpm:
            continue
        recs = [r for r in result.records if r.tenant == tenant]
        if not recs:
            continue
        span = max(r.arrival for r in recs) - min(r.arrival for r in recs)
        allowed = rpm + rpm * span / 60.0
        admitted = [0] * result.gateways
        for r in recs:
            if r.state != "rejected":
                admitted[r.gateway] += 1
        total = sum(admitted)
        out[tenant] = {
            "requests_per_minute": rpm,
            "offered": len(recs),
            "admitted": total,
            "allowed": allowed,
            "overshoot": total - allowed,
            "span_s": span,
            "admitted_per_gateway": admitted,
        }
    return out


def retry_stats(result: RunResult, slos: dict[str, Slo]) -> dict[str, Any]:
    """Clients that honour Retry-After (``--retries``), per class: of the requests whose first
    attempt was refused with a Retry-After, how many a later attempt got served, how many within
    the class's SLO counted from the *first* attempt's arrival (the client's own clock), how many
    ran out of attempts, and the delay from the first arrival to the first token."""
    first: dict[str, RequestRecord] = {}
    later: dict[str, list[RequestRecord]] = {}
    for r in result.records:
        if r.attempt == 0:
            first[r.rid] = r
        else:
            later.setdefault(r.retry_of, []).append(r)
    out: dict[str, Any] = {}
    for cls in result.classes:
        refused = [r for r in first.values()
                   if r.service_class == cls and r.state == "rejected" and r.rid in later]
        served = 0
        in_slo = 0
        gave_up = 0
        delays: list[float] = []
        attempts: list[int] = []
        slo = slos.get(cls)
        for r in refused:
            chain = sorted(later[r.rid], key=lambda x: x.attempt)
            attempts.append(1 + len(chain))
            done = next((x for x in chain if x.state == "completed"), None)
            if done is None:
                if all(x.state == "rejected" for x in chain):
                    gave_up += 1
                continue
            served += 1
            assert done.first_token_at is not None
            delays.append((done.first_token_at - r.arrival) * 1000.0)
            if slo is not None and meets_slo(replace(done, arrival=r.arrival), slo):
                in_slo += 1
        delays.sort()
        out[cls] = {
            "refused_first": len(refused),
            "served_later": served,
            "served_within_slo": in_slo,
            "gave_up": gave_up,
            "attempts_mean": mean([float(a) for a in attempts]),
            "ttft_from_first_p50_ms": percentile(delays, 50),
            "ttft_from_first_p99_ms": percentile(delays, 99),
        }
    return out
