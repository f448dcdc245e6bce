"""A live gateway's /metrics is the registry of metric names (``metric_names.py``): a gateway
in front of two stand-ins, with Redis, three tenants, a completion, a stream and an embeddings
call renders exactly the registered families, each with its registered type, exactly its
registered labels and its registered help text, and no registered family is missing from it.
(The registry against the board, the Prometheus files and the docs: ``tests/test_metric_names.py``.)
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from qosgate import metric_names as mn
from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.observability import ADMIN, Stack
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
