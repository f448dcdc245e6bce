"""The Grafana board and the Prometheus rules (``deploy/``) against a real Prometheus scraping a
real gateway in front of two real stand-in upstreams, with Redis for shared state.

- ``promtool check rules`` accepts the shipped rules file, and ``promtool check config`` the
  example ``prometheus.yml``;
- under a mixed load (four classes, three tenants, a tenant over its limit, a bad key, client
  cancellations, an idle-timed-out stream, a retried 503, embeddings) EVERY expression of the
  board, every template variable and every rule (recording rules as they are; alert rules with
  ``bool`` on their comparisons, so that they return data whether they fire or not) returns data
  through Prometheus' HTTP API, and every ``qosgate_*`` series they name exists in Prometheus
  (the gateway runs with ``fleet.tpot_guard: auto`` and a realtime TPOT budget, so that the
  guard's hold point has a series);
- staged faults fire every alert of the rules file: the realtime TTFT alert is inactive under
  the mixed load and fires once both stand-ins are slowed; killing a stand-in fires
  ``QosgateReplicaDown``, killing Redis ``QosgateSharedStateDegraded``; streams going silent on
  the stand-in left fire ``QosgateErrorRateHigh``; first bytes that never come get it ejected
  (``QosgateReplicaEjected``); an api request then waiting with no replica to go to fires
  ``QosgateClassStarving``; and ``QosgateClassBacklogGrowing`` fires along the way (the test
  checks that every alert of the file fired). Rules are loaded with their ``for:`` shortened to
  seconds (``short_for``), the only change from the shipped file;
- the board's "outcomes" panel sees every outcome kind: rejected, timed out, cancelled, failed.

Conditions are polled with deadlines (Prometheus evaluates rules every second here).

The helpers (``Stack``, ``Prometheus``, ``drive_mixed_load``) are in
``tests/support/observability.py``; ``bench/board_capture.py`` uses them too, to render the
board's data for docs/guides/operations.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.observability import (
    BOARD,
    ERROR_RATIO,
    PROM_EXAMPLE,
    REALTIME_BUDGET_MS,
    RULES,
    Stack,
    board_exprs,
    chat,
    drive_mixed_load,
    probe_timeout_and_retry,
    prometheus_binaries,
    qosgate_names,
    rule_list,
    short_for,
    substitute,
    with_bool,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.e2e


# ---------------------------------------------------------------- tests
def test_promtool_accepts_the_shipped_rules_and_example_config() -> None:
    _, tool = prometheus_binaries()
    r = subprocess.run([tool, "check", "rules", str(RULES)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    n = len(rule_list(RULES.read_text()))
    assert f"SUCCESS: {n} rules found" in r.stdout, r.stdout
    r = subprocess.run([tool, "check", "config", str(PROM_EXAMPLE)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    # the test's own rules file is the shipped one with shorter `for:`, and still valid
    assert short_for(RULES.read_text()) != RULES.read_text()
    assert [r.get("expr") for r in rule_list(short_for(RULES.read_text()))] == \
        [r.get("expr") for r in rule_list(RULES.read_text())]


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    prometheus_binaries()
    from tests.support.redis_server import redis_binary

    redis_binary()
    st = Stack(tmp_path, short_for(RULES.read_text()), offline_first_byte_s=3,
               tpot_guard="auto")
    try:
        yield st
    finally:
        st.close()


def test_board_and_rules_return_data_and_alerts_fire(stack: Stack) -> None:
    st, prom = stack, stack.prom
    t0 = time.time()
    marks: list[tuple[str, float]] = []
    assert wait_until(prom.scraped, timeout=20, every=0.2), prom.api("targets")

    # ---- mixed load. A realtime request first, scraped before the rest: a counter's first
    # sample is its baseline, so a class whose every request fell between two scrapes would have
    # no rate (and a NaN p99) in the window
    assert chat(st.client("sk-acme"), "realtime", 4) == "ok"
    assert wait_until(lambda: prom.query('qosgate_ttft_seconds_count{class="realtime"}'),
                      timeout=15, every=0.2)
    probe_timeout_and_retry(st)
    results = drive_mixed_load(st)
    assert results.get("ok", 0) > 50 and results.get("cancelled") == 4, results
    assert results.get("rate_limit_requests", 0) >= 1, results
    assert results.get("invalid_api_key") == 2, results
    # Prometheus has seen it: the realtime TTFT histogram and an SLO verdict
    assert wait_until(lambda: prom.query(
        'sum(qosgate_slo_requests_total{class="realtime"}) > 0'), timeout=15, every=0.25)
    # a healthy fleet keeps realtime within its budget: the alert must not be pending/firing
    def realtime_p99() -> float:
        v = prom.query('qosgate:class_ttft_seconds:p99_5m{class="realtime"}')
        return float(v[0]["value"][1]) if v else math.nan

    assert wait_until(lambda: not math.isnan(realtime_p99()), timeout=15, every=0.25)
    assert realtime_p99() < REALTIME_BUDGET_MS / 1000, realtime_p99()
    assert "QosgateRealtimeTTFTOverBudget" not in prom.alerts("firing") | prom.alerts("pending")
    marks.append(("mixed load done", time.time()))

    # ---- staged overload: both engines 40x slower -> realtime over its budget
    for i in (0, 1):
        st.fault(i, {"fault": "slow", "factor": 40})
    c, b = st.client("sk-acme"), st.client("sk-beta")
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        # batch work holding the windows without a first token: realtime arrivals preempt it
        batch = [pool.submit(chat, b, "batch", 8, "word " * 600, stream=True) for _ in range(8)]

        def slow_realtime() -> bool:
            list(pool.map(lambda _: chat(c, "realtime", 4), range(8)))
            return "QosgateRealtimeTTFTOverBudget" in prom.alerts()
        assert wait_until(slow_realtime, timeout=40, every=0.1), prom.api("alerts")
        for i in (0, 1):
            st.fault(i, None)
        assert all(f.result() for f in batch)
    marks.append(("realtime TTFT alert firing", time.time()))
    for i in (0, 1):
        st.fault(i, None)

    # ---- a replica killed with streams on it, and Redis gone
    c = st.client("sk-beta")

    def generated_at_b() -> float:
        _, _, body = http("GET", st.standins[1].url + "/metrics")
        return sum(metric_values(body.decode(), "vllm:generation_tokens_total").values())

    before = generated_at_b()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(chat, c, "batch", 400, stream=True) for _ in range(8)]
        # streams are running on b, well past their first bytes (64 tokens made there): killed
        # now, they end mid-stream. (Waiting only for requests in flight at b raced: those not
        # yet answered by a first byte are retried on a, and every stream then ended ok.)
        assert wait_until(lambda: st.metric("qosgate_replica_inflight", replica="b") > 0
                          and generated_at_b() >= before + 64, timeout=20)
        st.standins[1].proc.kill()
        st.redis.kill()
        outcomes = [f.result() for f in streams]
    assert any(o != "ok" for o in outcomes), outcomes
    assert wait_until(lambda: {"QosgateReplicaDown", "QosgateSharedStateDegraded"}
                      <= prom.alerts(), timeout=30, every=0.25), prom.api("alerts")
    marks.append(("replica-down and shared-state alerts firing", time.time()))

    # ---- errors, then a replica ejected: a (the one left) goes silent mid-stream, so streams
    # time out (idle), past 5% of the outcomes; then it never sends a first byte, so offline
    # attempts (first-byte timeout 3 s here) fail one after the other until outlier detection
    # ejects it
    st.fault(0, {"fault": "hang-mid-stream", "after": 1})
    c = st.client("sk-beta")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        silent = list(pool.map(lambda _: chat(c, "api", 50, stream=True), range(8)))
    assert all(o != "ok" for o in silent), silent
    assert wait_until(lambda: "QosgateErrorRateHigh" in prom.alerts(), timeout=30,
                      every=0.25), (prom.api("alerts"), prom.query(ERROR_RATIO))
    marks.append(("error-rate alert firing", time.time()))
    st.fault(0, None)
    st.fault(0, {"fault": "hang-first-byte"})
    quick = OpenAI(base_url=st.gw.url + "/v1", api_key="sk-beta", max_retries=0, timeout=20)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        hung = [pool.submit(chat, quick, "offline", 4, stream=True) for _ in range(6)]
        assert wait_until(lambda: "QosgateReplicaEjected" in prom.alerts(), timeout=40,
                          every=0.25), (prom.api("alerts"),
                                        st.metric("qosgate_attempt_failures_total"))
        marks.append(("replica-ejected alert firing", time.time()))
        st.fault(0, None)
        # with a ejected and b dead, an api request waits in the queue past api's starvation
        # ceiling (aging_after_s 10 s: api is aging's ceiling class)
        waiting = pool.submit(chat, quick, "api", 4)
        assert wait_until(lambda: "QosgateClassStarving" in prom.alerts(), timeout=30,
                          every=0.25), (prom.api("alerts"),
                                        prom.query("qosgate_queue_oldest_wait_seconds"))
        marks.append(("class-starving alert firing", time.time()))
        for f in [*hung, waiting]:  # (each ends as it may: served once a is back, or not)
            f.result()
    # the failed streams and the dead replica's stale signals have been scraped
    assert wait_until(lambda: prom.query(
        'sum(qosgate_requests_total{outcome="failed"}) > 0'), timeout=10, every=0.25)
    t1 = time.time()

    # ---- every expression of the board returns data over the run, with variables at "All"
    board = json.loads(BOARD.read_text())
    known = set(prom.api("label/__name__/values"))
    empty: list[str] = []
    for title, expr in board_exprs(board):
        missing = {n for n in qosgate_names(expr) if n not in known
                   and n + "_bucket" not in known}
        assert not missing, (title, expr, missing)
        if not prom.query_range(substitute(expr), t0, t1):
            empty.append(f"{title}: {expr}")
    assert not empty, "empty panels:\n" + "\n".join(empty)
    for var in board["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+), (\w+)\)", var["definition"])
        assert m, var["definition"]
        values = prom.api(f"label/{m.group(2)}/values", **{"match[]": substitute(m.group(1))})
        assert values, var["name"]

    # ---- every rule: recording rules as they are, alerts with bool comparisons
    rules = rule_list(RULES.read_text())
    for r in rules:
        expr = r["expr"] if "record" in r else with_bool(r["expr"])
        assert prom.query_range(expr, t0, t1), r
    fired = {s["metric"]["alertname"] for s in prom.query_range(
        'ALERTS{alertstate="firing"}', t0, time.time())}
    assert fired == {r["alert"] for r in rules if "alert" in r}, fired  # every alert, once
    recorded = {n for n in known if n.startswith("qosgate:")} | set(
        prom.api("label/__name__/values", **{"match[]": '{__name__=~"qosgate:.+"}'}))
    assert {r["record"] for r in rules if "record" in r} <= recorded

    # ---- the outcomes panel saw every kind of ending
    seen = {s["metric"]["outcome"] for s in prom.query_range(
        'sum by (outcome) (qosgate_requests_total{outcome!="completed"})', t0, t1)}
    assert seen >= {"rejected", "timed_out", "cancelled", "failed"}, seen
    n_exprs = len(board_exprs(board))
    pre = prom.query("sum(qosgate_preemptions_total)")
    preempted = pre[0]["value"][1] if pre else 0
    print(f"\nobservability: {results}; preemptions {preempted}; "
          + ", ".join(f"{m} at {t - t0:.1f} s" for m, t in marks)
          + f"; {n_exprs} board expressions and {len(rules)} rules evaluated over "
          f"{t1 - t0:.1f} s of data in {time.time() - t1:.1f} s")
