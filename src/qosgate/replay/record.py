"""A replay's attempts as the simulator's results: one ``RequestRecord`` per attempt (a retry is
its own record linked to the first, as the simulator records clients that honour Retry-After),
a ``RunResult`` and a ``Run`` whose metrics are ``sim.metrics``' -- so the table and the JSON
are ``qosgate simulate``'s own, field by field. What the simulator has and a client cannot see
(engine counters, queue samples, preemptions inside the gateway) is left empty or zero.

A replay also reports what the simulator's records do not keep: refusals by class, reason and
HTTP status, with their ``Retry-After`` (``refusals``).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from qosgate.replay.runner import Attempt
from qosgate.sim.metrics import analyze, limit_overshoot, percentile, retry_stats
from qosgate.sim.results import RequestRecord, RunResult
from qosgate.sim.scenarios import Prepared, Run, ScenarioResult


def record_of(a: Attempt, window: float) -> RequestRecord:
    ans = a.answer
    p = a.planned
    in_window = sum(1 for t in ans.chunk_times if t <= window)
    done_in = ans.state == "completed" and ans.finished_at <= window
    return RequestRecord(
        rid=a.rid,
        stream=p.stream,
        service_class=p.service_class,
        tenant=p.tenant,
        state=ans.state,
        reason=ans.reason,
        arrival=a.sent_at,
        first_token_at=ans.first_token_at,
        finished_at=ans.finished_at,
        prompt_tokens=p.prompt,
        output_tokens=ans.output_tokens,
        target_output=p.output,
        preemptions=0,
        promotions=0,
        win_prefilled=ans.first_token_at is not None and ans.first_token_at <= window,
        win_output=ans.output_tokens if done_in else in_window,
        retry_of=a.retry_of,
        attempt=a.attempt,
    )


def refusals(attempts: list[Attempt]) -> list[dict[str, Any]]:
    """Refused attempts by class, reason and status, with their Retry-After (seconds)."""
    groups: dict[tuple[str, str, int], list[float | None]] = {}
    for a in attempts:
        ans = a.answer
        if ans.state != "rejected":
            continue
        key = (a.planned.service_class, ans.reason, ans.status)
        groups.setdefault(key, []).append(ans.retry_after)
    out = []
    for (cls, reason, status), ras in sorted(groups.items()):
        given = sorted(x for x in ras if x is not None)
        out.append({"class": cls, "reason": reason, "status": status, "count": len(ras),
                    "with_retry_after": len(given),
                    "retry_after_p50_s": percentile(given, 50),
                    "retry_after_max_s": given[-1] if given else None})
    return out


def measured(prep: Prepared, attempts: list[Attempt], stream_names: list[str], window: float,
             offered_rps: float, load: float | None, label: str = "measured") -> ScenarioResult:
    """The replay as a one-run ``ScenarioResult`` (policy ``label``)."""
    cfg = prep.cfg
    records = [record_of(a, window) for a in attempts]
    states = Counter(r.state for r in records)
    result = RunResult(
        policy=label,
        classes=tuple(c.name for c in cfg.classes),
        records=records,
        samples=[],
        arrivals_end=window,
        makespan=max((r.finished_at for r in records), default=0.0),
        arrivals=len(records),
        outcomes=dict(sorted(states.items())),
        fleet={"replicas": [], "attempt_failures": {}, "retries": {}, "faults": []},
    )
    tier = {t.name: t.tier for t in cfg.tenants}
    weight = {t.name: t.weight for t in cfg.tenants}
    s = prep.scenario
    metrics = analyze(
        result, prep.slos, lambda t: tier.get(t, "-"), cfg.fairness.prompt_weight,
        cfg.fairness.output_weight, lambda t: weight.get(t, 1.0),
        stream_names, s.warmup_s,
    )
    metrics["gateways"] = []
    metrics["limits"] = limit_overshoot(result, {t.name: t.limits for t in cfg.tenants})
    if any(r.attempt for r in records) or s.retries:
        metrics["retries"] = retry_stats(result, prep.slos)
    metrics["refusals"] = refusals(attempts)
    run = Run(label, load, offered_rps, result, metrics)
    return ScenarioResult(prep, [run])
