"""``qosgate replay`` against a real gateway process in front of the stand-in: every request's
outcome is counted exactly once (the replay's records against the gateway's own ledger,
``qosgate_requests_total``), and a refusal's reason, status and Retry-After reach the report."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.httpclient import http
from tests.support.metrics import metric_values
from tests.support.processes import QOSGATE, Server, start_gateway, start_standin

pytestmark = pytest.mark.e2e

# a light tenant, and one with a tight requests/min limit: 2 in its bucket, then refused
CONFIG: dict[str, Any] = {
    "tenants": [
        {"name": "light", "api_keys": ["k-light"]},
        {"name": "tight", "api_keys": ["k-tight"], "limits": {"requests_per_minute": 2}},
    ],
}
SCENARIO: dict[str, Any] = {
    "name": "replay-test",
    "policies": ["qos"],
    "seed": 7,
    "duration_s": 3,
    "arrivals": {"process": "poisson", "rate": 5},
    "lengths": {"prompt": {"dist": "constant", "value": 64},
                "output": {"dist": "constant", "value": 8}},
    "mix": [{"share": 1, "tenant": "light", "class": "realtime"},
            {"share": 1, "tenant": "tight", "class": "batch"}],
    "config": CONFIG,
    "tpot_slo_ms": {"realtime": 200, "api": 200, "batch": 1000, "offline": 1000},
}


def gateway_and_scenario(tmp: Path, config: dict[str, Any],
                         scenario: dict[str, Any]) -> tuple[Server, Server, Path]:
    """A stand-in, a gateway in front of it with ``config``, and ``scenario`` written out."""
    standin = start_standin(tmp, "--scheduling-policy", "priority")
    cfg = tmp / "gateway.yaml"
    cfg.write_text(yaml.safe_dump({**config, "upstreams": [{"url": standin.url,
                                                              "name": "s0"}]}))
    gw = start_gateway(tmp, "--config", str(cfg))
    path = tmp / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario))
    return standin, gw, path


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    standin, gw, scenario = gateway_and_scenario(tmp_path_factory.mktemp("replay"), CONFIG,
                                                 SCENARIO)
    yield gw, scenario
    gw.stop()
    standin.stop()


def ledger(gw: Server) -> Counter[tuple[str, str, str, str]]:
    _, _, text = http("GET", gw.url + "/metrics")
    out: Counter[tuple[str, str, str, str]] = Counter()
    for labels, v in metric_values(text.decode(), "qosgate_requests_total").items():
        d = dict(labels)
        out[(d["class"], d["tenant"], d["outcome"], d["reason"])] += int(v)
    return out


def test_replay_counts_every_outcome_once_and_reports_refusals(
    servers: tuple[Server, Path], tmp_path: Path
) -> None:
    gw, scenario = servers
    before = ledger(gw)
    out = tmp_path / "replay.json"
    proc = subprocess.run(
        [*QOSGATE, "replay", gw.url, "--scenario", str(scenario), "--json-only", "--out",
         str(out), "--max-seconds", "60"],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == doc
    after = ledger(gw)
    delta = after - before
    run = doc["runs"][0]
    n = doc["replay"]["planned"]
    assert n > 4
    # one record per request, each with one outcome, and the gateway counted the same
    assert run["arrivals"] == run["recorded"] == n and run["one_outcome_each"]
    assert sum(run["outcomes"].values()) == n == sum(delta.values())
    for cls, g in run["classes"].items():
        for outcome in ("completed", "rejected", "timed_out", "cancelled", "failed"):
            gw_count = sum(v for (c, _, o, _), v in delta.items() if c == cls and o == outcome)
            assert g[outcome] == gw_count, (cls, outcome, g, delta)
    for tenant, g in run["tenants"].items():
        assert g["count"] == sum(v for (_, t, _, _), v in delta.items() if t == tenant)
    # the tight tenant's refusals: reason, status and Retry-After as the gateway sent them
    refused = delta[("batch", "tight", "rejected", "rate_limit_requests")]
    assert refused > 0
    rows = doc["replay"]["refusals"]
    assert rows == [r for r in rows if r["reason"] == "rate_limit_requests"]
    assert [(r["class"], r["status"], r["count"]) for r in rows] == [("batch", 429, refused)]
    assert rows[0]["with_retry_after"] == refused and rows[0]["retry_after_p50_s"] > 0
    assert run["classes"]["realtime"]["completed"] == run["classes"]["realtime"]["count"]
    # the document is the simulator's: the same top-level keys and per-class fields
    assert {"format", "scenario", "slo", "definitions", "runs"} <= set(doc)
    assert "ttft_p50_ms" in run["classes"]["realtime"]



# a tenant allowed one request at a time: of four sent at once, three are refused (429,
# Retry-After: 1), and a client with retries waits each refusal out until it is served
BURST_CONFIG: dict[str, Any] = {
    "tenants": [{"name": "burst", "api_keys": ["k-burst"], "limits": {"max_concurrent": 1}}],
}


def test_retries_wait_out_retry_after_and_are_reported(tmp_path: Path) -> None:
    standin, gw, scenario = gateway_and_scenario(
        tmp_path, BURST_CONFIG,
        {**SCENARIO, "config": BURST_CONFIG, "mix": [{"share": 1, "tenant": "burst"}]})
    requests = tmp_path / "requests.jsonl"
    requests.write_text("".join(
        json.dumps({"t": 0, "prompt_tokens": 64, "output_tokens": 40, "tenant": "burst",
                    "class": "api"}) + "\n" for _ in range(4)))
    try:
        before = ledger(gw)
        proc = subprocess.run(
            [*QOSGATE, "replay", gw.url, "--scenario", str(scenario), "--requests",
             str(requests), "--json-only", "--retries", "10", "--max-seconds", "60",
             "--compare-sim", "default"],
            capture_output=True, text=True, timeout=120, check=False,
        )
        delta = ledger(gw) - before
    finally:
        gw.stop()
        standin.stop()
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    run = doc["runs"][0]
    assert doc["replay"]["planned"] == 4
    refused = delta[("api", "burst", "rejected", "concurrency_limit")]
    assert refused >= 3
    # every attempt, first or retry, is one record here and one outcome at the gateway
    assert run["recorded"] == sum(delta.values()) == 4 + refused
    assert run["outcomes"] == {"completed": 4, "rejected": refused}
    assert sum(v for (_, _, o, _), v in delta.items() if o == "completed") == 4
    rows = doc["replay"]["refusals"]
    assert [(r["reason"], r["status"], r["count"], r["with_retry_after"]) for r in rows] == [
        ("concurrency_limit", 429, refused, refused)]
    # three first attempts were refused and served later, each after a Retry-After of 1 s
    stats = run["retries"]["api"]
    assert stats["refused_first"] == 3 and stats["served_later"] == 3
    assert stats["gave_up"] == 0
    assert stats["ttft_from_first_p50_ms"] >= 1000
    # --compare-sim: the class measured beside its prediction, with the relative error
    cmp = doc["compare_sim"]["classes"]
    assert set(cmp) == {"api", "all"} and doc["compare_sim"]["profile"] == "default"
    for fig in cmp["api"].values():
        assert set(fig) == {"measured", "predicted", "rel_error", "difference"}
    assert cmp["api"]["ttft_p50_ms"]["predicted"] > 0


def test_a_gateway_with_keys_needs_the_replays_key_and_says_so(
    servers: tuple[Server, Path], tmp_path: Path
) -> None:
    """A built-in scenario carries keys of its own: against a gateway with other keys, the
    replay stops before sending anything, with the status and how to pass a key, with or
    without ``--model``; with ``--api-key`` every request goes with that key, and the report
    lists failures by status (none here)."""
    gw, _ = servers
    before = ledger(gw)
    base = [*QOSGATE, "replay", gw.url, "--scenario", "seed-classes", "--max-requests", "3",
            "--max-seconds", "30", "--json-only"]
    for extra in ([], ["--model", "smollm2-135m-instruct"]):
        proc = subprocess.run([*base, *extra], capture_output=True, text=True, timeout=120,
                              check=False)
        assert proc.returncode == 2, proc.stdout
        assert "HTTP 401" in proc.stderr and "--api-key" in proc.stderr, proc.stderr
    assert ledger(gw) == before  # nothing was sent
    proc = subprocess.run([*base, "--api-key", "k-light"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["replay"]["planned"] == 3 and doc["replay"]["failures"] == []
    assert doc["replay"]["profile"] and doc["replay"]["rate_rps"] > 0
    delta = ledger(gw) - before
    assert sum(delta.values()) == 3
    assert {t for (_, t, _, _) in delta} == {"light"}
