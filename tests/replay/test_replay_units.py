"""The replay's pure parts: the host check, the bounds, the bodies, the relative error."""

from __future__ import annotations

import json

import pytest

from qosgate.core.prefix import Prefix
from qosgate.replay.bodies import body, text_of, token_ids
from qosgate.replay.cli import bounded, check_host
from qosgate.replay.compare import rel_error
from qosgate.replay.plan import Planned, plan_workload
from qosgate.sim.scenario_file import ScenarioError, load_scenario, override
from qosgate.sim.scenarios import prepare, workload_for


def test_only_loopback_unless_allowed() -> None:
    assert check_host("127.0.0.1:8000/", []) == "http://127.0.0.1:8000"
    assert check_host("http://localhost:1", []) == "http://localhost:1"
    assert check_host("http://[::1]:1", []) == "http://[::1]:1"
    with pytest.raises(ScenarioError, match="--allow-host"):
        check_host("http://10.0.0.5:8000", [])
    assert check_host("http://10.0.0.5:8000", ["10.0.0.5"]) == "http://10.0.0.5:8000"


@pytest.mark.slow
def test_the_plan_is_the_simulators_workload_bounded() -> None:
    prep = prepare(override(load_scenario("seed-classes"), duration_s=20.0))
    wl = workload_for(prep)
    cut = bounded(wl, 10, 1e9)
    plan = plan_workload(prep, cut)
    assert [p.rid for p in plan] == [a.rid for a in wl.arrivals[:10]]
    assert cut.duration == wl.arrivals[10].t
    assert {p.service_class for p in plan} <= {"realtime", "api", "batch", "offline"}
    assert all(p.prompt == a.prompt and p.output == a.output
               for p, a in zip(plan, wl.arrivals, strict=False))


def test_token_prompts_have_the_exact_length_and_ask_for_the_output() -> None:
    p = Planned("r1", 0.0, 0, "api", "t", "k", 37, 5)
    path, raw = body(p, "m", token_prompts=True)
    doc = json.loads(raw)
    assert path == "/v1/completions" and len(doc["prompt"]) == 37
    assert doc["max_tokens"] == 5 and doc["ignore_eos"] and doc["stream"]
    assert len(json.dumps(doc["prompt"], separators=(",", ":"))) // 4 == 37
    path, raw = body(p, "m", token_prompts=False)
    text = json.loads(raw)["messages"][0]["content"]
    assert path == "/v1/chat/completions" and len(text.split()) == 37


def test_prompts_share_the_traces_blocks_and_nothing_else() -> None:
    """Two requests naming the same leading block ids share exactly those tokens; a request
    without blocks shares nothing; another seed (another replay) shares nothing with this one,
    the same seed sends the same bytes."""
    a = Planned("r1", 0.0, 0, "api", "t", "k", 40, 5, Prefix((7, 8, 9), 16))
    b = Planned("r2", 0.0, 0, "api", "t", "k", 50, 5, Prefix((7, 8, 3), 16))
    c = Planned("r3", 0.0, 0, "api", "t", "k", 40, 5)
    ta, tb, tc = (token_ids("s1", x) for x in (a, b, c))
    assert (len(ta), len(tb), len(tc)) == (40, 50, 40)
    assert ta[:32] == tb[:32] and ta[32:36] != tb[32:36]  # two shared blocks of 16
    assert ta[:4] != tc[:4]
    assert token_ids("s1", a) == ta and token_ids("s2", a)[:4] != ta[:4]
    # a prompt shorter than its blocks is cut, and text prompts follow the same blocks
    short = Planned("r4", 0.0, 0, "api", "t", "k", 20, 5, Prefix((7, 8), 16))
    assert token_ids("s1", short) == ta[:20]
    assert text_of("s1", a).split()[:32] == text_of("s1", b).split()[:32]


def test_relative_error() -> None:
    assert rel_error(100.0, 120.0) == pytest.approx(0.2)
    assert rel_error(None, 1.0) is None and rel_error(0.0, 1.0) is None
