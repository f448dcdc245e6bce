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

The helpers (``Stack``, ``Prometheus``, ``drive_mixed_load``) are reused by
``bench/board_capture.py``, which renders the board's data for docs/guides/operations.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.gateway.conftest import (
    MODEL,
    Server,
    free_port,
    http,
    metric_values,
    start_gateway,
    start_standin,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "qosgate.rules.yml"
PROM_EXAMPLE = ROOT / "deploy" / "prometheus" / "prometheus.yml"
BOARD = ROOT / "deploy" / "grafana" / "qosgate.json"
ADMIN = "sk-admin"
REALTIME_BUDGET_MS = 500  # tight: a slowed stand-in misses it, a healthy one does not
TENANTS = [
    {"name": "acme", "api_keys": ["sk-acme"], "weight": 3},
    {"name": "beta", "api_keys": ["sk-beta"], "weight": 1},
    {"name": "free", "api_keys": ["sk-free"], "weight": 1, "tier": "pro",
     "limits": {"requests_per_minute": 3}},
]


def _ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def prometheus_binaries() -> tuple[str, str]:
    """``prometheus`` and ``promtool`` (Debian package ``prometheus``; ``make test`` installs it
    with scripts/apt_env.sh): skip when missing, but fail in CI."""
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    if prom is None or tool is None:
        msg = "prometheus/promtool not installed (apt-get install -y prometheus; make test does)"
        if _ci():
            pytest.fail(msg)
        pytest.skip(msg)
    return prom, tool


# ---------------------------------------------------------------- expressions
def short_for(rules_text: str, duration: str = "2s") -> str:
    """The rules file with every ``for:`` set to ``duration`` (production values would keep a
    test waiting minutes); nothing else changes."""
    return re.sub(r"(?m)^(\s+for:\s*)\S+", r"\g<1>" + duration, rules_text)


def with_bool(expr: str) -> str:
    """An alert expression with ``bool`` on its comparisons (written `` > `` with spaces, see the
    rules file's header): 0/1 instead of a filter, so it returns data whether it fires or not."""
    return re.sub(r" (>=|<=|==|!=|>|<) (?!bool)", r" \1 bool ", expr)


def board_exprs(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel."""
    out: list[tuple[str, str]] = []
    for p in board["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    return out


def substitute(expr: str, rate_interval: str = "15s") -> str:
    """A board expression as Grafana sends it with every variable at "All" (``.*``)."""
    expr = expr.replace("$__rate_interval", rate_interval).replace("${__rate_interval}",
                                                                   rate_interval)
    return re.sub(r"\$\{?(instance|class|tenant|replica)\}?", ".*", expr)


def rule_list(rules_text: str) -> list[dict[str, Any]]:
    import yaml

    return [r for g in yaml.safe_load(rules_text)["groups"] for r in g["rules"]]


def qosgate_names(text: str) -> set[str]:
    return set(re.findall(r"qosgate_[a-z0-9_]+", text))


# ---------------------------------------------------------------- Prometheus
class Prometheus:
    """A real ``prometheus`` on a free loopback port, its TSDB in ``tmp``, scraping ``targets``
    every ``scrape_s`` with the admin key and evaluating ``rules_text`` as often."""

    def __init__(self, tmp: Path, targets: list[str], rules_text: str,
                 scrape_s: float = 1.0) -> None:
        prom, _ = prometheus_binaries()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        d = tmp / f"prometheus-{self.port}"
        d.mkdir()
        (d / "rules.yml").write_text(rules_text)
        interval = f"{scrape_s:g}s"
        (d / "prometheus.yml").write_text(json.dumps({
            "global": {"scrape_interval": interval, "evaluation_interval": interval,
                       "scrape_timeout": interval},
            "rule_files": [str(d / "rules.yml")],
            "scrape_configs": [{"job_name": "qosgate", "authorization": {"credentials": ADMIN},
                                "static_configs": [{"targets": targets}]}],
        }))
        self.log = d / "prometheus.log"
        self._log_f = self.log.open("wb")
        self.proc = subprocess.Popen(
            [prom, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log_f, stderr=subprocess.STDOUT)
        ok = wait_until(lambda: self.proc.poll() is None and
                        http("GET", self.url + "/-/ready", timeout=1)[0] == 200, timeout=30)
        if not ok:
            self.stop()
            raise RuntimeError("prometheus did not start: " + self.log.read_text())

    def api(self, path: str, **params: str) -> Any:
        qs = urllib.parse.urlencode(params)
        code, _, body = http("GET", f"{self.url}/api/v1/{path}?{qs}", timeout=30)
        out = json.loads(body)
        assert code == 200 and out["status"] == "success", (path, params, out)
        return out["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def query_range(self, expr: str, start: float, end: float,
                    step: float = 1.0) -> list[dict[str, Any]]:
        return list(self.api("query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}",
                             step=f"{step:g}")["result"])

    def alerts(self, state: str = "firing") -> set[str]:
        return {a["labels"]["alertname"] for a in self.api("alerts")["alerts"]
                if a["state"] == state}

    def scraped(self) -> bool:
        """Every target has been scraped successfully at least once."""
        targets = self.api("targets")["activeTargets"]
        return bool(targets) and all(t["health"] == "up" for t in targets)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_f.close()


# ---------------------------------------------------------------- the stack
def gateway_config(upstreams: list[Server], redis_url: str | None,
                   offline_first_byte_s: float | None = None,
                   tpot_guard: str | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "classes": [
            {"name": "realtime", "level": 0, "strict": True, "ttft_budget_ms": REALTIME_BUDGET_MS,
             "queue_timeout_s": 30, "max_queue": 2000, "can_preempt": True,
             "reserved_share": 0.25},
            {"name": "api", "level": 1, "weight": 5, "ttft_budget_ms": 5000,
             "queue_timeout_s": 60, "max_queue": 2000, "aging_after_s": 10},
            {"name": "batch", "level": 2, "weight": 3, "ttft_budget_ms": 30000,
             "queue_timeout_s": 120, "max_queue": 2000, "aging_after_s": 30,
             "preemptible": True},
            {"name": "offline", "level": 3, "weight": 2, "ttft_budget_ms": 300000,
             "queue_timeout_s": 300, "max_queue": 2000, "aging_after_s": 60,
             "preemptible": True},
        ],
        "tenants": TENANTS,
        # most-free: with both replicas idle the first one listed gets the request (the
        # timed-out and retried probes below rely on where a request lands only loosely)
        "fleet": {"router": "most-free", "window": {"mode": "fixed"}},
        "server": {"admin_keys": [ADMIN], "metrics_auth": True},
        "upstreams": [
            {"url": s.url, "name": name, "capacity": 4, "priority_polarity": "vllm",
             "idle_timeout_s": 3}
            for name, s in zip("ab", upstreams, strict=False)
        ],
    }
    if redis_url is not None:
        cfg["redis"] = {"url": redis_url}
    if offline_first_byte_s is not None:  # the test's ejection stage; not the board capture's
        cfg["classes"][3]["first_byte_timeout_s"] = offline_first_byte_s
    if tpot_guard is not None:  # the test's: the guard's hold point is on the board only with
        # it, and the guard needs a strict class with a TPOT budget to protect
        cfg["fleet"]["tpot_guard"] = tpot_guard
        cfg["classes"][0]["tpot_budget_ms"] = 200
    return cfg


class Stack:
    """Two stand-ins (replicas ``a`` and ``b``), Redis, a gateway, and (given rules) Prometheus
    scraping it; ``close`` stops what is still running."""

    def __init__(self, tmp: Path, rules_text: str | None, redis: bool = True,
                 offline_first_byte_s: float | None = None,
                 tpot_guard: str | None = None) -> None:
        self.tmp = tmp
        self.closers: list[Callable[[], object]] = []
        try:
            self.redis: Any = None
            if redis:
                from tests.gateway.redis_server import RedisServer

                self.redis = RedisServer(tmp)
                self.closers.append(self.redis.stop)
            self.standins: list[Server] = []
            for _ in range(2):
                s = start_standin(tmp, "--scheduling-policy", "priority")
                self.closers.append(s.stop)
                self.standins.append(s)
            cfg = tmp / "gateway.json"
            cfg.write_text(json.dumps(gateway_config(
                self.standins, self.redis.url if self.redis is not None else None,
                offline_first_byte_s, tpot_guard)))
            self.gw = start_gateway(tmp, "--config", str(cfg))
            self.closers.append(self.gw.stop)
            if rules_text is not None:
                self.prom = Prometheus(tmp, [f"127.0.0.1:{self.gw.port}"], rules_text)
                self.closers.append(self.prom.stop)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        for c in reversed(self.closers):
            with contextlib.suppress(Exception):
                c()
        self.closers.clear()

    def fault(self, i: int, spec: dict[str, Any] | None) -> None:
        """Switch a fault on at stand-in ``i`` (``None``: clear them all)."""
        url = self.standins[i].url + "/admin/fault"
        if spec is None:
            code = http("DELETE", url)[0]
        else:
            code = http("POST", url, json.dumps(spec).encode(),
                        {"Content-Type": "application/json"})[0]
        assert code == 200, (i, spec, code)

    def client(self, key: str) -> OpenAI:
        return OpenAI(base_url=self.gw.url + "/v1", api_key=key, max_retries=0, timeout=60)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of ``name``'s samples on the gateway's /metrics whose labels include
        ``labels``."""
        from tests.gateway.conftest import metric_values

        code, _, body = http("GET", self.gw.url + "/metrics",
                             headers={"Authorization": f"Bearer {ADMIN}"})
        assert code == 200
        want = set(labels.items())
        return sum(v for k, v in metric_values(body.decode(), name).items() if want <= set(k))


ERROR_RATIO = "qosgate:requests_error:ratio_5m"


def chat(c: OpenAI, cls: str, max_tokens: int, prompt: str = "hello", stream: bool = False,
         cancel: bool = False) -> str:
    """One chat request of class ``cls``: ``ok``, or the error's code; ``cancel`` closes a
    stream after its first chunk (the gateway counts it cancelled)."""
    try:
        if stream:
            s = c.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens, stream=True, extra_headers={"x-qos-class": cls})
            for _ in s:
                if cancel:
                    s.close()
                    return "cancelled"
            return "ok"
        c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
            extra_headers={"x-qos-class": cls})
        return "ok"
    except Exception as exc:
        return getattr(exc, "code", None) or type(exc).__name__


def drive_mixed_load(st: Stack, rounds: int = 2) -> dict[str, int]:
    """Every class, three tenants (one over its requests/min), a bad key, cancelled streams and
    embeddings, concurrently; returns the client-side results counted."""
    acme, beta, free = st.client("sk-acme"), st.client("sk-beta"), st.client("sk-free")
    bad = st.client("sk-nobody")
    long_prompt = "word " * 600  # long prefill: batch work that holds a slot before its 1st token
    jobs: list[Callable[[], str]] = []
    for _ in range(rounds):
        jobs += [lambda: chat(acme, "realtime", 8, stream=True) for _ in range(12)]
        jobs += [lambda: chat(beta, "realtime", 8) for _ in range(4)]
        jobs += [lambda: chat(beta, "api", 24) for _ in range(8)]
        jobs += [lambda: chat(acme, "api", 24, stream=True) for _ in range(4)]
        jobs += [lambda: chat(acme, "batch", 64, long_prompt, stream=True) for _ in range(6)]
        jobs += [lambda: chat(beta, "offline", 64, long_prompt) for _ in range(6)]
        jobs += [lambda: chat(free, "api", 8) for _ in range(4)]
        jobs += [lambda: chat(bad, "api", 8)]
        jobs += [lambda: chat(beta, "batch", 200, stream=True, cancel=True) for _ in range(2)]
        jobs += [lambda: ("ok" if beta.embeddings.create(model=MODEL, input=["a b c", "d e"])
                          else "none") for _ in range(2)]
    results: dict[str, int] = {}
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        for r in pool.map(lambda f: f(), jobs):
            results[str(r)] = results.get(str(r), 0) + 1
    return results


def probe_timeout_and_retry(st: Stack) -> None:
    """One stream that goes silent mid-way at whichever stand-in takes it (``timed_out``,
    ``idle_timeout``), and one request whose first attempt gets a 503 (retried elsewhere)."""
    c = st.client("sk-beta")
    for i in (0, 1):
        st.fault(i, {"fault": "hang-mid-stream", "after": 1, "count": 1})
    assert chat(c, "api", 50, stream=True) != "ok"
    for i in (0, 1):
        st.fault(i, None)
        st.fault(i, {"fault": "503", "retry_after": 1, "count": 1})
    chat(c, "api", 8)
    for i in (0, 1):
        st.fault(i, None)


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
    from tests.gateway.redis_server import redis_binary

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
