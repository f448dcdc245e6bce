"""What a ``bench/goodput.py`` load phase recorded, and the tables and JSON it is read into.

Kept apart from the driver so that the accounting (what counts as refused, within its SLO,
admitted) is in one place, readable without the processes around it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bench.fleet_faults import Rec, pct
from bench.openai_retry import asked_delay

REFUSED = (429, 503)


@dataclass
class Request:
    """One request as its user sees it: the first attempt and the retries after refusals."""

    i: int
    cls: str
    budget_s: float  # the class's TTFT objective
    attempts: list[Rec] = field(default_factory=list)

    @property
    def last(self) -> Rec:
        return self.attempts[-1]

    @property
    def ttft(self) -> float | None:
        """From the first attempt's send to the first event of the last one (a retried request
        waits for its refusals and the Retry-After too)."""
        if self.last.first is None:
            return None
        return self.last.first - self.attempts[0].sent

    @property
    def completed(self) -> bool:
        return self.last.outcome == "completed"

    @property
    def refused(self) -> bool:
        return self.last.status in REFUSED

    @property
    def timed_out(self) -> bool:
        return self.last.outcome == "client_timeout"

    @property
    def within_slo(self) -> bool:
        ttft = self.ttft
        return self.completed and ttft is not None and ttft <= self.budget_s


@dataclass
class Phase:
    """One gateway at one load factor."""

    gateway: str
    factor: float
    rate: float
    t0: float = 0.0  # when the arrivals began (monotonic)
    load_s: float = 0.0  # the arrival window
    requests: list[Request] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)  # the gateway's, summed over classes
    waiting: list[float] = field(default_factory=list)  # the engines', summed
    running: list[float] = field(default_factory=list)


def asked(rec: Rec) -> float | None:
    return asked_delay(rec.retry_after_ms, rec.retry_after)


# ---------------------------------------------------------------------- per class
def class_row(ph: Phase, reqs: list[Request]) -> dict[str, Any]:
    done = [r for r in reqs if r.completed]
    met = sum(r.within_slo for r in reqs)
    refused = [r for r in reqs if r.refused]
    admitted = len(reqs) - len(refused)
    ttfts = [t for r in done if (t := r.ttft) is not None]
    return {
        "sent": len(reqs),
        "completed": len(done),
        "within_slo": met,
        "goodput_per_s": met / ph.load_s if ph.load_s else 0.0,
        "refused": len(refused),
        "refused_with_retry_after": sum(asked(r.last) is not None for r in refused),
        "client_timeouts": sum(r.timed_out for r in reqs),
        "other": len(reqs) - len(done) - len(refused) - sum(r.timed_out for r in reqs),
        "ttft_p50_s": pct(ttfts, 50),
        "ttft_p90_s": pct(ttfts, 90),
        "admitted_met_share": met / admitted if admitted else None,
    }


def classes_of(ph: Phase) -> list[str]:
    seen = {r.cls for r in ph.requests}
    return [c for c in ("realtime", "api", "batch", "offline") if c in seen] + sorted(
        seen - {"realtime", "api", "batch", "offline"})


def rows(ph: Phase) -> dict[str, dict[str, Any]]:
    out = {c: class_row(ph, [r for r in ph.requests if r.cls == c]) for c in classes_of(ph)}
    if len(out) > 1:
        out["all"] = class_row(ph, ph.requests)
    return out


# ---------------------------------------------------------------------- retries, backlog
def retry_stats(ph: Phase) -> dict[str, Any]:
    retries = [a for r in ph.requests for a in r.attempts[1:]]
    refusals = [a for r in ph.requests for a in r.attempts if a.status in REFUSED]
    delays = [d for a in refusals if (d := asked(a)) is not None]
    buckets = Counter(math.floor(a.sent - ph.t0) for a in retries)
    admitted = sum(a.status not in REFUSED for a in retries)
    return {
        "retries_sent": len(retries),
        "retries_admitted": admitted,
        "retry_success_rate": admitted / len(retries) if retries else None,
        "retry_after_p50_s": pct(delays, 50),
        "retry_after_p90_s": pct(delays, 90),
        "retry_after_max_s": max(delays, default=None),
        "landings_max_per_s": max(buckets.values(), default=0),
        "landings_mean_per_busy_s": len(retries) / len(buckets) if buckets else 0.0,
    }


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def backlog(ph: Phase) -> dict[str, float]:
    return {
        "gateway_queue_mean": _mean(ph.queue), "gateway_queue_max": max(ph.queue, default=0.0),
        "engine_waiting_mean": _mean(ph.waiting),
        "engine_waiting_max": max(ph.waiting, default=0.0),
        "engine_running_mean": _mean(ph.running),
    }


# ---------------------------------------------------------------------- printing
def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.0f}%"


def print_tables(phases: list[Phase], with_retries: bool) -> None:
    for factor in sorted({p.factor for p in phases}):
        at = [p for p in phases if p.factor == factor]
        print(f"\nload {factor:g}x = {at[0].rate:.2f} req/s, {at[0].load_s:.0f} s of arrivals")
        print(f"{'gateway':<9}{'class':<9}{'sent':>6}{'completed':>10}{'in SLO':>8}"
              f"{'goodput/s':>10}{'refused (RA)':>14}{'time-outs':>10}{'other':>6}"
              f"{'TTFT p50 / p90 s':>18}{'admitted met':>13}")
        for p in at:
            for cls, r in rows(p).items():
                refused = f"{r['refused']} ({r['refused_with_retry_after']})"
                ttft = f"{_s(r['ttft_p50_s'])} / {_s(r['ttft_p90_s'])}"
                print(f"{p.gateway:<9}{cls:<9}{r['sent']:>6}{r['completed']:>10}"
                      f"{r['within_slo']:>8}{r['goodput_per_s']:>10.2f}{refused:>14}"
                      f"{r['client_timeouts']:>10}{r['other']:>6}{ttft:>18}"
                      f"{_share(r['admitted_met_share']):>13}")
        print(f"{'gateway':<9}{'gateway queue mean / max':>26}{'engines waiting mean / max':>28}"
              f"{'engines running mean':>22}")
        for p in at:
            b = backlog(p)
            queue = (f"{b['gateway_queue_mean']:.1f} / {b['gateway_queue_max']:.0f}"
                     if p.queue else "-")
            waiting = f"{b['engine_waiting_mean']:.1f} / {b['engine_waiting_max']:.0f}"
            print(f"{p.gateway:<9}{queue:>26}{waiting:>28}{b['engine_running_mean']:>22.1f}")
        if with_retries:
            print(f"{'gateway':<9}{'retries':>8}{'admitted':>9}{'success':>8}"
                  f"{'Retry-After p50 / p90 / max s':>31}{'landings max/s vs mean/busy s':>31}")
            for p in at:
                s = retry_stats(p)
                ra = (f"{_s(s['retry_after_p50_s'])} / {_s(s['retry_after_p90_s'])} / "
                      f"{_s(s['retry_after_max_s'])}")
                land = f"{s['landings_max_per_s']} vs {s['landings_mean_per_busy_s']:.1f}"
                print(f"{p.gateway:<9}{s['retries_sent']:>8}{s['retries_admitted']:>9}"
                      f"{_share(s['retry_success_rate']):>8}{ra:>31}{land:>31}")
    print_summary(phases)


def print_summary(phases: list[Phase]) -> None:
    """Goodput at each factor over goodput at the lowest one (1x by default), per gateway."""
    factors = sorted({p.factor for p in phases})
    print(f"\ngoodput/s (x that at {factors[0]:g}x), all classes")
    print(f"{'gateway':<9}" + "".join(f"{f:g}x".rjust(16) for f in factors))
    for gw in dict.fromkeys(p.gateway for p in phases):
        by = {p.factor: class_row(p, p.requests)["goodput_per_s"] for p in phases
              if p.gateway == gw}
        base = by.get(factors[0])
        cells = [
            "-" if f not in by else
            f"{by[f]:.2f} (x{by[f] / base:.2f})" if base else f"{by[f]:.2f}"
            for f in factors]
        print(f"{gw:<9}" + "".join(f"{c:>16}" for c in cells))


# ---------------------------------------------------------------------- JSON
def _attempt(a: Rec, t0: float) -> dict[str, Any]:
    return {"sent": a.sent - t0, "first": None if a.first is None else a.first - t0,
            "end": None if a.end is None else a.end - t0, "status": a.status,
            "outcome": a.outcome, "retry_after_s": asked(a)}


def phase_json(ph: Phase) -> dict[str, Any]:
    return {
        "gateway": ph.gateway, "factor": ph.factor, "rate": ph.rate, "load_s": ph.load_s,
        "classes": rows(ph), "retries": retry_stats(ph), "backlog": backlog(ph),
        "samples": {"gateway_queue": ph.queue, "engine_waiting": ph.waiting,
                    "engine_running": ph.running},
        "requests": [{"i": r.i, "class": r.cls, "budget_s": r.budget_s, "ttft": r.ttft,
                      "attempts": [_attempt(a, ph.t0) for a in r.attempts]}
                     for r in ph.requests],
    }
