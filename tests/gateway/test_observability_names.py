"""One registry of metric names (``metric_names.py``) that everything else agrees with.

- a live gateway (two stand-ins, Redis, three tenants, a completion, a stream, an embeddings
  call) renders exactly the registered families on /metrics, each with its registered type and
  exactly its registered labels, and no registered family is missing from it;
- every ``qosgate_*`` name in the board, the Prometheus files, README.md and docs/**/*.md is a
  registered family (or one of its ``_bucket``/``_count``/``_sum``/``_created`` series);
- the committed board is what ``deploy/grafana/make_board.py`` writes;
- what the new metrics count: SLO met/missed against the class's budget, tokens per tenant
  label (capped to ``other``), the weights and the starvation waits derived from the config.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qosgate import metric_names as mn
from qosgate.config import Tenant, default_config
from qosgate.core import Request, Scheduler, State
from qosgate.server.metrics import GatewayMetrics, starvation_waits
from tests.support.files import load_module
from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.observability import ADMIN, ROOT, Stack, qosgate_names
from tests.support.processes import MODEL


def _labels_by_family(text: str) -> dict[str, tuple[str, set[frozenset[str]]]]:
    """{family name as the parser names it: (type, label-name sets seen, ``le`` left out)}."""
    out: dict[str, tuple[str, set[frozenset[str]]]] = {}
    for fam in text_string_to_metric_families(text):
        sets = {frozenset(k for k in s.labels if k != "le") for s in fam.samples}
        out[fam.name] = (fam.type, sets)
    return out


def scrape(st: Stack) -> str:
    code, _, body = http("GET", st.gw.url + "/metrics",
                         headers={"Authorization": f"Bearer {ADMIN}"})
    assert code == 200
    return body.decode()


@pytest.fixture
def live(tmp_path: Path) -> tuple[str, str, int]:
    """/metrics after two completions (and the output tokens their usage reported), and after a
    stream and an embeddings call too."""
    from tests.support.redis_server import redis_binary

    redis_binary()
    st = Stack(tmp_path, None)
    try:
        c = st.client("sk-acme")
        usage = [c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=n,
            extra_headers={"x-qos-class": cls}).usage for n, cls in ((4, "realtime"), (7, "api"))]
        served = sum(u.completion_tokens for u in usage if u is not None)
        first = scrape(st)
        list(c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, stream=True))
        c.embeddings.create(model=MODEL, input=["a b", "c"])
        # two scrapes: the second carries the event-loop lag and render time of the first
        scrape(st)
        return scrape(st), first, served
    finally:
        st.close()


@pytest.mark.e2e
def test_live_metrics_are_the_registry(live: tuple[str, str, int]) -> None:
    live_text, first, served = live
    seen = _labels_by_family(live_text)
    by_base = {f.base: f for f in mn.FAMILIES.values()}
    ours = {name: v for name, v in seen.items() if name.startswith("qosgate_")}
    # prometheus_client writes a histogram's _created samples as a gauge family of their own
    for name in [n for n in ours if n.endswith("_created")]:
        fam = mn.family_of(name)
        assert fam is not None and fam.kind == "histogram", name
        assert ours.pop(name)[1] == {frozenset(fam.labels)}, name
    unregistered = sorted(set(ours) - set(by_base))
    assert not unregistered, unregistered
    missing = sorted(set(by_base) - set(ours))
    assert not missing, f"registered but not on /metrics: {missing}"
    for name, (kind, label_sets) in ours.items():
        fam = by_base[name]
        assert kind == fam.kind, (name, kind, fam.kind)
        for labels in label_sets:
            assert labels == set(fam.labels), (name, sorted(labels), fam.labels)
    # the families that must carry samples after this traffic
    for name in ("qosgate_slo_requests_total", "qosgate_tenant_tokens_total",
                 "qosgate_tenant_weight", "qosgate_replica_signals_age_seconds",
                 "qosgate_process_cpu_seconds_total", "qosgate_event_loop_lag_seconds",
                 "qosgate_metrics_render_seconds", "qosgate_tpot_seconds_count",
                 "qosgate_shared_state_degraded", "qosgate_embeddings_batches_total"):
        assert metric_values(live_text, name), name
    # the output tokens counted for the tenant are those its responses' usage reported
    tokens = metric_values(first, "qosgate_tenant_tokens_total")
    assert tokens[(("kind", "output"), ("tenant", "acme"))] == served


@pytest.mark.e2e
def test_live_help_texts_are_the_registrys(live: tuple[str, str, int]) -> None:
    """The help text of every family on /metrics is its registered one: each family's text is
    written once, in ``metric_names.py``, whichever module emits it."""
    for fam in text_string_to_metric_families(live[0]):
        if not fam.name.startswith("qosgate_") or fam.name.endswith("_created"):
            continue
        reg = mn.family_of(fam.name) or mn.family_of(fam.name + "_total")
        assert reg is not None and fam.documentation == reg.help, fam.name


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
