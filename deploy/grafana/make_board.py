"""Writes ``deploy/grafana/qosgate.json``, the Grafana board, from the panel list below.

The JSON is what operators import; this script is how it is kept consistent (one place for the
variables and the datasource of every panel). ``tests/test_metric_names.py``
checks that the committed JSON is what this script writes; ``tests/e2e/test_observability.py``
evaluates every expression of it against a real Prometheus scraping a real gateway.

    .venv/bin/python deploy/grafana/make_board.py        # rewrites deploy/grafana/qosgate.json
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("qosgate.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
RI = "$__rate_interval"
I = 'instance=~"$instance"'  # noqa: E741 - the matcher every query carries
IC = I + ',class=~"$class"'
IT = I + ',tenant=~"$tenant"'
IR = I + ',replica=~"$replica"'


# service per tenant in VTC units: tokens of each kind times what fairness charges for them
SERVICE_BY = ("sum by (instance, tenant) (rate(qosgate_tenant_tokens_total{{{m}}}[" + RI
              + "]) * on (instance, kind) group_left qosgate_fairness_token_cost)")
SERVICE = ("sum by (tenant) (rate(qosgate_tenant_tokens_total{{{m}}}[" + RI
           + "]) * on (instance, kind) group_left qosgate_fairness_token_cost)")


def q(expr: str, legend: str) -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend}


def quantiles(metric: str, by: str, matcher: str) -> list[dict[str, Any]]:
    return [
        q(f"histogram_quantile({p}, sum by ({by}, le) (rate({metric}_bucket{{{matcher}}}[{RI}])))",
          f"{{{{{by}}}}} p{int(p * 100)}")
        for p in (0.5, 0.99)
    ]


# (row title, [(panel title, unit, description, [targets], panel type)])
ROWS: list[tuple[str, list[tuple[str, str, str, list[dict[str, Any]], str]]]] = [
    ("Classes", [
        ("Queue depth", "short", "Requests queued in the gateway per class (the backlog the "
         "scheduler decides on).",
         [q(f"sum by (class) (qosgate_queue_depth{{{IC}}})", "{{class}}")], "timeseries"),
        ("Oldest wait vs starvation ceiling", "s", "Wait of the oldest queued request per "
         "class; dashed: the wait past which it is starving (aging should have lifted it to "
         "the ceiling class and served it).",
         [q(f"max by (class) (qosgate_queue_oldest_wait_seconds{{{IC}}})", "{{class}}"),
          q(f"max by (class) (qosgate_class_starvation_seconds{{{IC}}})",
            "{{class}} starving past")], "timeseries"),
        ("In flight", "short", "Requests at an engine per class.",
         [q(f"sum by (class) (qosgate_inflight{{{IC}}})", "{{class}}")], "timeseries"),
        ("TTFT p50 / p99 vs budget", "s", "Arrival to first token (queueing included); "
         "dashed: the class's TTFT budget.",
         [*quantiles("qosgate_ttft_seconds", "class", IC),
          q(f"max by (class) (qosgate_class_ttft_budget_seconds{{{IC}}})", "{{class}} budget")],
         "timeseries"),
        ("E2E p50 / p99", "s", "Arrival to completion of completed requests.",
         quantiles("qosgate_e2e_seconds", "class", IC), "timeseries"),
        ("Queue wait p50 / p99", "s", "Arrival to dispatch: the time the scheduler held "
         "the request.",
         quantiles("qosgate_queue_wait_seconds", "class", IC), "timeseries"),
        ("SLO attainment", "percentunit", "Completed requests that met their class's TTFT "
         "budget, over all completed (per class).",
         [q(f'sum by (class) (rate(qosgate_slo_requests_total{{{IC},slo="met"}}[{RI}])) / '
            f"sum by (class) (rate(qosgate_slo_requests_total{{{IC}}}[{RI}]))", "{{class}}")],
         "timeseries"),
        ("Completed per second", "reqps", "Throughput per class.",
         [q(f'sum by (class) (rate(qosgate_requests_total{{{IC},outcome="completed"}}[{RI}]))',
            "{{class}}")], "timeseries"),
        ("Outcomes by reason (not completed)", "reqps", "Rejected (429/503: limits, queue "
         "caps, predicted overload), timed out, cancelled (client left) and failed (engine "
         "broke), per second, by reason.",
         [q(f'sum by (outcome, reason) (rate(qosgate_requests_total{{{IC},'
            f'outcome!="completed"}}[{RI}]))', "{{outcome}} {{reason}}")], "timeseries"),
        ("TPOT p50 / p99", "s", "Time per output token after the first, completed requests.",
         quantiles("qosgate_tpot_seconds", "class", IC), "timeseries"),
        ("Preemptions", "ops", "Requests pulled back for a more urgent one, per second.",
         [q(f"sum by (class) (rate(qosgate_preemptions_total{{{IC}}}[{RI}]))", "{{class}}")],
         "timeseries"),
    ]),
    ("Tenants", [
        ("Share of service vs fair share", "percentunit", "Each tenant's share of the "
         "service, in what fair sharing charges (tokens times qosgate_fairness_token_cost: "
         "prompt and output weights); dashed: its weight's share among the tenants served "
         "in the window (what fair sharing aims at when all of them are backlogged).",
         [q(f"{SERVICE.format(m=IT)} / scalar(sum({SERVICE.format(m=I)}))", "{{tenant}} served"),
          q(f"sum by (tenant) (qosgate_tenant_weight{{{IT}}} and on (instance, tenant) "
            f"({SERVICE_BY.format(m=I)} > 0)) / scalar(sum(qosgate_tenant_weight{{{I}}} and on "
            f"(instance, tenant) ({SERVICE_BY.format(m=I)} > 0)))", "{{tenant}} fair")],
         "timeseries"),
        ("Tokens per second", "short", "Tokens served per tenant, prompt and output.",
         [q(f"sum by (tenant, kind) (rate(qosgate_tenant_tokens_total{{{IT}}}[{RI}]))",
            "{{tenant}} {{kind}}")], "timeseries"),
        ("Limit refusals", "reqps", "Requests refused by the tenant's own limits "
         "(requests/min, tokens/min, concurrency; model_: its limits on one model), per second.",
         [q(f'sum by (tenant, reason) (rate(qosgate_requests_total{{{IT},outcome="rejected",'
            f'reason=~"(model_)?(rate_limit_requests|rate_limit_tokens|concurrency_limit)"}}'
            f'[{RI}]))',
            "{{tenant}} {{reason}}")], "timeseries"),
        ("Queued / in flight", "short", "Per tenant, summed over classes.",
         [q(f"sum by (tenant) (qosgate_tenant_queued{{{IT}}})", "{{tenant}} queued"),
          q(f"sum by (tenant) (qosgate_tenant_inflight{{{IT}}})", "{{tenant}} in flight")],
         "timeseries"),
    ]),
    ("Replicas", [
        ("In flight vs window", "short", "Requests in flight per replica; dashed: the window "
         "in force (what the gateway lets it hold).",
         [q(f"sum by (replica) (qosgate_replica_inflight{{{IR}}})", "{{replica}} in flight"),
          q(f"sum by (replica) (qosgate_replica_capacity{{{IR}}})", "{{replica}} window")],
         "timeseries"),
        ("Health: up, eligible, breaker open", "short", "up: its health probe answers; "
         "eligible: may take work now; breaker open: ejected by outlier detection.",
         [q(f"min by (replica) (qosgate_replica_up{{{IR}}})", "{{replica}} up"),
          q(f"min by (replica) (qosgate_replica_eligible{{{IR}}})", "{{replica}} eligible"),
          q(f"max by (replica) (qosgate_replica_breaker_open{{{IR}}})", "{{replica}} open")],
         "state-timeline"),
        ("Retries and failed attempts", "ops", "Engine calls that failed before the first "
         "byte, and those retried on another replica, per second.",
         [q(f"sum by (replica, reason) (rate(qosgate_attempt_failures_total{{{IR}}}[{RI}]))",
            "{{replica}} failed {{reason}}"),
          q(f"sum by (replica, reason) (rate(qosgate_retries_total{{{IR}}}[{RI}]))",
            "{{replica}} retried {{reason}}")], "timeseries"),
        ("Signals scrape age", "s", "Age of the engine's last load signals (its /metrics "
         "scrape); stale signals count as saturated for routing.",
         [q(f"max by (replica) (qosgate_replica_signals_age_seconds{{{IR}}})", "{{replica}}")],
         "timeseries"),
        ("Engine: running, waiting, KV use", "short", "What the engine itself reports "
         "(its /metrics, scraped every second): sequences running, queued inside the "
         "engine (the gateway's window keeps this near 0), KV cache in use (0-1).",
         [q(f"max by (replica) (qosgate_replica_engine_running{{{IR}}})", "{{replica}} running"),
          q(f"max by (replica) (qosgate_replica_engine_waiting{{{IR}}})", "{{replica}} waiting"),
          q(f"max by (replica) (qosgate_replica_engine_kv_usage_ratio{{{IR}}})",
            "{{replica}} KV")], "timeseries"),
        ("Engine: time per token, TPOT guard", "s", "The engine's mean time per output "
         "token between its last two scrapes (what every stream on it gets); dashed: the TPOT "
         "guard's hold point (absent with fleet.tpot_guard off); others held: 1 while the "
         "guard keeps the other classes' new requests off a replica streaming to realtime.",
         [q(f"max by (replica) (qosgate_replica_engine_itl_seconds{{{IR}}})",
            "{{replica}} time per token"),
          q(f"max by (replica) (qosgate_replica_tpot_guard_seconds{{{IR}}})",
            "{{replica}} hold point"),
          q(f"max by (replica) (qosgate_replica_others_held{{{IR}}})",
            "{{replica}} others held")], "timeseries"),
        ("Replica TTFT p50 / p99", "s", "Dispatch to first token: the engine's part of TTFT.",
         quantiles("qosgate_replica_ttft_seconds", "replica", IR), "timeseries"),
        ("Ejections and cooling", "short", "Outlier ejections in the window, and the "
         "back-pressure (Retry-After) left.",
         [q(f"sum by (replica) (increase(qosgate_replica_ejections_total{{{IR}}}[{RI}]))",
            "{{replica}} ejections"),
          q(f"max by (replica) (qosgate_replica_cooling_seconds{{{IR}}})",
            "{{replica}} cooling s")], "timeseries"),
        ("Embeddings batches", "ops", "Embeddings batches released per second by reason.",
         [q(f"sum by (replica, reason) (rate(qosgate_embeddings_batches_total{{{IR}}}[{RI}]))",
            "{{replica}} {{reason}}")], "timeseries"),
    ]),
    ("Batch jobs", [
        ("Jobs by status", "short", "Batch jobs (the OpenAI Batch API) by status, as the "
         "batch store holds them (every instance sharing it reports the same).",
         [q(f"max by (status) (qosgate_batch_jobs{{{I}}})", "{{status}}")], "timeseries"),
        ("Job lines by outcome", "ops", "Job lines ended per second: completed, failed (to the "
         "error file), retried after an engine failure, waited on a refusal, expired, "
         "cancelled.",
         [q(f"sum by (outcome) (rate(qosgate_batch_lines_total{{{I}}}[{RI}]))",
            "{{outcome}}")], "timeseries"),
        ("Job lines in flight vs spare slots", "short", "Lines each instance has handed to "
         "the scheduler, and the slots live traffic leaves free for them.",
         [q(f"sum by (instance) (qosgate_batch_lines_in_flight{{{I}}})",
            "{{instance}} in flight"),
          q(f"sum by (instance) (qosgate_batch_spare_slots{{{I}}})",
            "{{instance}} spare")], "timeseries"),
    ]),
    ("Gateway", [
        ("CPU", "percentunit", "CPU of the gateway process (1 = one core), and CPU seconds "
         "per request.",
         [q(f"sum by (instance) (rate(qosgate_process_cpu_seconds_total{{{I}}}[{RI}]))",
            "{{instance}} cores"),
          q(f"sum by (instance) (rate(qosgate_process_cpu_seconds_total{{{I}}}[{RI}])) / "
            f"sum by (instance) (rate(qosgate_requests_total{{{I}}}[{RI}]))",
            "{{instance}} s/request")], "timeseries"),
        ("Event loop lag and /metrics render", "s", "How long ready work waited for the "
         "event loop (probed at each scrape), and the previous scrape's render time.",
         [q(f"max by (instance) (qosgate_event_loop_lag_seconds{{{I}}})", "{{instance}} lag"),
          q(f"max by (instance) (qosgate_metrics_render_seconds{{{I}}})",
            "{{instance}} render")], "timeseries"),
        ("Connections", "short", "Open client connections, and connections refused before "
         "a request (per second).",
         [q(f"sum by (instance) (qosgate_open_connections{{{I}}})", "{{instance}} open"),
          q(f"sum by (reason) (rate(qosgate_connections_refused_total{{{I}}}[{RI}]))",
            "refused {{reason}}")], "timeseries"),
        ("Shared state", "short", "1 while the shared-state store (Redis) is unreachable; "
         "live instances at the last sync.",
         [q(f"max by (instance) (qosgate_shared_state_degraded{{{I}}})",
            "{{instance}} degraded"),
          q(f"max by (instance) (qosgate_shared_state_live_instances{{{I}}})",
            "{{instance}} live instances")], "timeseries"),
    ]),
]


def variable(name: str, query: str) -> dict[str, Any]:
    return {
        "name": name, "label": name, "type": "query", "datasource": DS,
        "definition": query, "query": {"query": query, "refId": f"{name}-var"},
        "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [], "sort": 1, "hide": 0,
    }


def board() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid = 1
    y = 0
    for title, items in ROWS:
        panels.append({"id": pid, "type": "row", "title": title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid += 1
        y += 1
        for i, (ptitle, unit, desc, targets, ptype) in enumerate(items):
            overrides = [
                {"matcher": {"id": "byRegexp",
                             "options": ".*(budget|starving past|window|fair|hold point)"},
                 "properties": [{"id": "custom.lineStyle",
                                 "value": {"fill": "dash", "dash": [10, 10]}}]}
            ] if ptype == "timeseries" else []
            panels.append({
                "id": pid, "type": ptype, "title": ptitle, "description": desc,
                "datasource": DS,
                "gridPos": {"h": 8, "w": 8, "x": 8 * (i % 3), "y": y + 8 * (i // 3)},
                "fieldConfig": {"defaults": {"unit": unit}, "overrides": overrides},
                "options": {"legend": {"displayMode": "list", "placement": "bottom",
                                       "showLegend": True}},
                "targets": [{**t, "refId": chr(ord("A") + k), "datasource": DS}
                            for k, t in enumerate(targets)],
            })
            pid += 1
        y += 8 * ((len(items) + 2) // 3)
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus",
                      "description": "the Prometheus that scrapes the gateways",
                      "type": "datasource", "pluginId": "prometheus",
                      "pluginName": "Prometheus"}],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
            {"type": "panel", "id": "state-timeline", "name": "State timeline", "version": ""},
        ],
        "annotations": {"list": []},
        "title": "qosgate",
        "uid": "qosgate-gateway",
        "description": "qosgate: classes, tenants, replicas and the gateway itself "
                       "(docs/guides/operations.md)",
        "tags": ["qosgate", "llm", "inference"],
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus", "current": {"text": "Prometheus",
                                                "value": "${DS_PROMETHEUS}"},
             "hide": 0, "refresh": 1, "options": []},
            variable("instance", "label_values(qosgate_queue_depth, instance)"),
            variable("class", 'label_values(qosgate_queue_depth{instance=~"$instance"}, class)'),
            variable("tenant",
                     'label_values(qosgate_tenant_weight{instance=~"$instance"}, tenant)'),
            variable("replica",
                     'label_values(qosgate_replica_up{instance=~"$instance"}, replica)'),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(board(), indent=2) + "\n"


if __name__ == "__main__":
    OUT.write_text(render())
    print(f"wrote {OUT}")
