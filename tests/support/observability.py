"""A real Prometheus scraping a real gateway in front of two real stand-in upstreams, with Redis
for shared state (``Stack``), and the shipped board and rules read for their expressions: what
the observability tests and ``bench/board_capture.py`` drive.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import urllib.parse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.ports import free_port
from tests.support.processes import MODEL, Server, start_gateway, start_standin
from tests.support.waiting import wait_until

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
        # (a stream that goes silent ends at its idle bound, as the alerts are probed with,
        # instead of moving to the other replica)
        "fleet": {"router": "most-free", "window": {"mode": "fixed"},
                  "retries": {"max_moves": 0}},
        "server": {"admin_keys": [ADMIN], "metrics_auth": True},
        "upstreams": [
            {"url": s.url, "name": name, "max_window": 4, "priority_polarity": "vllm",
             "idle_timeout_s": 3}
            for name, s in zip("ab", upstreams, strict=False)
        ],
    }
    for c in cfg["classes"]:  # admitted on queue time: the outcomes the board shows are driven
        c["deadline_admission"] = False  # one by one (a deadline refusal would replace them)
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
                from tests.support.redis_server import RedisServer

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
