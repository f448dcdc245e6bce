"""One registry of metric names (``metric_names.py``) that everything else agrees with.

- every ``qosgate_*`` name in the board, the Prometheus files, README.md and docs/**/*.md is a
  registered family (or one of its ``_bucket``/``_count``/``_sum``/``_created`` series);
- the committed board is what ``deploy/grafana/make_board.py`` writes;
- what the new metrics count: SLO met/missed against the class's budget, tokens per tenant
  label (capped to ``other``), the weights and the starvation waits derived from the config.

A live gateway's /metrics against the registry: ``tests/e2e/test_metric_names.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from qosgate import metric_names as mn
from qosgate.config import Tenant, default_config
from qosgate.core import Request, Scheduler, State
from qosgate.server.metrics import GatewayMetrics, starvation_waits
from tests.support.files import load_module
from tests.support.metrics import metric_values
from tests.support.observability import ROOT, qosgate_names


def _names_in(path: Path) -> set[str]:
    return qosgate_names(path.read_text())


def test_every_name_in_board_rules_and_docs_is_registered() -> None:
    files = [ROOT / "deploy" / "grafana" / "qosgate.json", ROOT / "README.md",
             *sorted((ROOT / "deploy" / "prometheus").glob("*.yml")),
             *sorted((ROOT / "docs").rglob("*.md"))]
    unknown: dict[str, set[str]] = {}
    checked = 0
    for f in files:
        for name in _names_in(f):
            checked += 1
            if mn.family_of(name) is None:
                unknown.setdefault(str(f.relative_to(ROOT)), set()).add(name)
    assert not unknown, unknown
    assert checked > 50  # the files do name metrics: the regex did not silently match nothing
    assert mn.family_of("qosgate_ttft_seconds_bucket") is mn.TTFT
    assert mn.family_of("qosgate_requests_bucket") is None
    assert mn.family_of("qosgate_queue_depth_sum") is None  # a gauge has no _sum


def test_board_json_is_generated() -> None:
    mod = load_module("deploy/grafana/make_board.py")
    assert (ROOT / "deploy" / "grafana" / "qosgate.json").read_text() == mod.render(), \
        "run .venv/bin/python deploy/grafana/make_board.py"
    board = json.loads(mod.render())
    assert board["schemaVersion"] == 39
    assert board["__inputs"][0]["name"] == "DS_PROMETHEUS"
    assert board["__inputs"][0]["pluginId"] == "prometheus"
    names = {v["name"] for v in board["templating"]["list"]}
    assert names == {"datasource", "instance", "class", "tenant", "replica"}


def test_registry_follows_prometheus_naming() -> None:
    for f in mn.FAMILIES.values():
        assert re.fullmatch(r"qosgate_[a-z0-9_]+", f.name), f.name
        assert (f.kind == "counter") == f.name.endswith("_total"), f.name
        if "seconds" in f.name:
            assert f.unit == "seconds", f.name
        assert not re.search(r"_(ms|milliseconds|minutes|bytes_total_total)\b", f.name), f.name
    bases = [f.base for f in mn.FAMILIES.values()]
    assert len(bases) == len(set(bases))


# ---------------------------------------------------------------- what the new metrics count
def _req(i: int, cls: str, level: int, tenant: str, ttft: float, out_tokens: int,
         tpot: float, state: State = State.COMPLETED) -> Request:
    r = Request(f"r{i}", tenant, cls, level, arrival=100.0, deadline=101.0, prompt_tokens=10,
                max_tokens=64)
    r.dispatched_at = 100.0
    r.first_token_at = 100.0 + ttft
    r.output_tokens = out_tokens
    r.finished_at = r.first_token_at + tpot * max(0, out_tokens - 1)
    r.state = state
    r.replica = "x"
    return r


def test_slo_and_tenant_tokens_and_config_gauges() -> None:
    tenants = tuple(Tenant(name=f"t{i}", api_keys=(f"k{i}",), weight=i + 1) for i in range(4))
    cfg = default_config(tenants=tenants)
    gm = GatewayMetrics(Scheduler(cfg), clock=lambda: 0.0)
    gm.cap_tenants(2)  # t0, t1 named; t2, t3 -> other
    gm.observe(_req(1, "realtime", 0, "t0", 0.5, 10, 0.01))  # met (budget 1 s)
    gm.observe(_req(2, "realtime", 0, "t1", 1.5, 10, 0.01))  # missed
    gm.observe(_req(3, "api", 1, "t2", 0.1, 1, 0.0))  # met, one token: no TPOT
    gm.observe(_req(4, "api", 1, "t3", 9.0, 5, 0.01, State.CANCELLED))  # not judged: cancelled
    text = gm.render().decode()
    slo = metric_values(text, "qosgate_slo_requests_total")
    assert slo == {(("class", "realtime"), ("slo", "met")): 1,
                   (("class", "realtime"), ("slo", "missed")): 1,
                   (("class", "api"), ("slo", "met")): 1,
                   (("class", "api"), ("slo", "missed")): 0}
    tok = metric_values(text, "qosgate_tenant_tokens_total")
    assert tok[(("kind", "output"), ("tenant", "other"))] == 1 + 5  # the cancelled one's too
    assert tok[(("kind", "prompt"), ("tenant", "other"))] == 20
    assert tok[(("kind", "output"), ("tenant", "t0"))] == 10
    weights = metric_values(text, "qosgate_tenant_weight")
    assert weights == {(("tenant", "t0"),): 1, (("tenant", "t1"),): 2,
                       (("tenant", "other"),): 3 + 4, (("tenant", "default"),): 1}
    assert metric_values(text, "qosgate_tpot_seconds_count") == {(("class", "realtime"),): 2}
    budget = metric_values(text, "qosgate_class_ttft_budget_seconds")
    assert budget[(("class", "realtime"),)] == 1.0 and budget[(("class", "offline"),)] == 300.0


def test_starvation_waits_follow_aging() -> None:
    assert starvation_waits(default_config()) == {"realtime": 1.0, "api": 10.0, "batch": 40.0,
                                                  "offline": 100.0}
    off = default_config(aging={"enabled": False})
    assert starvation_waits(off) == {"realtime": 1.0, "api": 10.0, "batch": 30.0,
                                     "offline": 60.0}
