"""The simulator with prefixes: the Mooncake trace format, the ideal hit rate, a ``--router``
list, and the prefix-cache figures in the report and the JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qosgate.cli import app
from qosgate.core.prefix import Prefix
from qosgate.sim.prefix_stats import ideal_hits
from qosgate.sim.scenario_file import ScenarioError, load_scenario, scenario_from_mapping
from qosgate.sim.scenarios import prepare, run_scenario
from qosgate.sim.workload import Arrival, read_trace

runner = CliRunner()


def _line(t_ms: float, prompt: int, output: int, ids: list[int]) -> str:
    return json.dumps(
        {"timestamp": t_ms, "input_length": prompt, "output_length": output, "hash_ids": ids}
    )


def _conversations(n_sessions: int = 4, turns: int = 3, gap_ms: int = 4000) -> list[str]:
    """Multi-turn chats: turn k of a session repeats its k earlier turns' blocks and adds 2."""
    lines = []
    next_id = 100
    t = 0
    for _turn in range(turns):
        for s in range(n_sessions):
            lines.append((s, t))
            t += gap_ms
    history: dict[int, list[int]] = {}
    out = []
    for s, t in lines:
        ids = history.setdefault(s, [0])  # block 0: a system prompt every chat shares
        ids += [next_id, next_id + 1]
        next_id += 2
        out.append(_line(t, 512 * len(ids) - 100, 20, list(ids)))
    return out


def _trace(tmp_path: Path, lines: list[str], name: str = "moon.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return p


def test_mooncake_rows_sorted_in_seconds_with_their_blocks(tmp_path: Path) -> None:
    p = _trace(tmp_path, [_line(3000, 700, 5, [0, 1]), "", _line(1000, 0, 9, [0, 2, 3])],
               name="moon.txt")  # told apart by content, not only by extension
    rows = read_trace(p)
    assert [(r.t, r.prompt, r.output) for r in rows] == [(0.0, 1, 9), (2.0, 700, 5)]
    assert rows[0].prefix == Prefix((0, 2, 3), 512) and rows[1].prefix == Prefix((0, 1), 512)


@pytest.mark.parametrize(
    ("line", "says"),
    [
        ("{not json", "line 2: not JSON"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1}', "line 2: missing hash_ids"),
        ('{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [1, "a"]}',
         "line 2: hash_ids must be a list of integers"),
        ('{"timestamp": 1, "input_length": -5, "output_length": 1, "hash_ids": []}',
         "line 2: input_length must be a whole number >= 0"),
        ('{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": []}',
         "line 2: timestamp must be milliseconds"),
        ("[1, 2]", "line 2: expected a JSON object"),
    ],
)
def test_bad_mooncake_lines_name_the_line(tmp_path: Path, line: str, says: str) -> None:
    p = _trace(tmp_path, [_line(0, 5, 1, [1]), line], name=f"bad{abs(hash(line))}.jsonl")
    with pytest.raises(ValueError, match=says):
        read_trace(p)


def test_ideal_hit_rate_by_hand() -> None:
    def arr(i: int, prompt: int, keys: tuple[int, ...] | None) -> Arrival:
        pf = None if keys is None else Prefix(keys, 4)
        return Arrival(float(i), f"r{i}", 0, prompt, 1, 1, pf)

    arrivals = [
        arr(0, 12, (1, 2, 3)),  # nothing cached yet
        arr(1, 12, (1, 2, 4)),  # 1, 2 cached; 3 blocks would be 12 = the whole prompt: cap 2
        arr(2, 13, (1, 2, 4, 9)),  # 1, 2, 4 cached (4 was left by the last); 9 is partial
        arr(3, 5, None),  # no identity: queried, never hit
        arr(4, 9, (1, 5, 6)),  # 1 cached, 5 not: the run stops there
    ]
    assert ideal_hits(arrivals) == (8 + 12 + 4, 12 + 12 + 13 + 5 + 9)
    # an LRU of 2 blocks: each request keeps its head (released tail first), so after the
    # first two only 1, 2 are left: the third finds 1, 2 and not 4
    assert ideal_hits(arrivals[:3], cache_tokens=8) == (8 + 8, 12 + 12 + 13)


SCENARIO = """
name: moon
description: multi-turn chats on {time_scale}
profile: qwen2.5-7b-instruct-h100
replicas: 2
window: auto
policies: [qos]
seed: 3
duration_s: null
arrivals: {process: trace, time_scale: 1.0}
trace: TRACE
lengths:
  prompt: {dist: trace}
  output: {dist: trace}
mix:
  - {share: 1, class: realtime}
  - {share: 1, class: batch}
tpot_slo_ms: {realtime: 200, api: 200, batch: 1000, offline: 1000}
"""


def _scenario(tmp_path: Path, lines: list[str], **changes: object) -> Path:
    trace = _trace(tmp_path, lines)
    text = SCENARIO.replace("TRACE", str(trace))
    for k, v in changes.items():
        text = text.replace(f"{k}: ", f"{k}: {v} #", 1)
    p = tmp_path / "moon.yaml"
    p.write_text(text)
    return p


def test_one_replica_with_room_reaches_the_ideal(tmp_path: Path) -> None:
    """Spaced requests on one replica whose cache holds everything: every block a request could
    find is there, so the engine's hit rate is the ideal."""
    p = _scenario(tmp_path, _conversations(), replicas=1)
    res = run_scenario(prepare(load_scenario(p)))
    pc = res.runs[0].metrics["prefix_cache"]
    assert pc["ideal_hit_rate"] > 0.4
    assert pc["hit_rate"] == pytest.approx(pc["ideal_hit_rate"])
    assert pc["prefill_tokens_computed"] == pc["prefill_tokens_offered"] - pc["hits_tokens"]
    assert pc["replicas"]["r0"]["queries"] == pc["prefill_tokens_offered"]


def test_router_list_runs_each_router_side_by_side(tmp_path: Path) -> None:
    p = _scenario(tmp_path, _conversations())
    res = runner.invoke(app, ["simulate", "--scenario", str(p), "--router",
                              "least-load,most-free", "--json-only"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert [r["router"] for r in doc["runs"]] == ["least-load", "most-free"]
    assert doc["runs"][0]["arrivals"] == doc["runs"][1]["arrivals"] == 12
    for run in doc["runs"]:
        pc = run["prefix_cache"]
        assert set(pc["replicas"]) == {"r0", "r1"}
        assert pc["hits_tokens"] == sum(r["hits"] for r in pc["replicas"].values())
        assert 0 <= pc["hit_rate"] <= pc["ideal_hit_rate"]
        assert pc["ideal_fleet_kv_hit_rate"] == pc["ideal_hit_rate"]  # a tiny trace fits
    table = runner.invoke(app, ["simulate", "--scenario", str(p), "--router",
                                "least-load,most-free"])
    assert table.exit_code == 0, table.output
    assert "qos least-load" in table.output and "qos most-free" in table.output
    assert "prefix cache" in table.output and "TTFT by class" in table.output


def test_one_router_keeps_the_single_run_shape(tmp_path: Path) -> None:
    p = _scenario(tmp_path, _conversations())
    res = runner.invoke(app, ["simulate", "--scenario", str(p), "--router", "most-free",
                              "--json-only"])
    assert res.exit_code == 0, res.output
    runs = json.loads(res.output)["runs"]
    assert [(r["policy"], r["router"]) for r in runs] == [("qos", "most-free")]
    table = runner.invoke(app, ["simulate", "--scenario", str(p)])
    assert "qos least-load" not in table.output  # one router: runs labelled as before


def test_bad_router_in_a_list_is_a_clean_error(tmp_path: Path) -> None:
    p = _scenario(tmp_path, _conversations())
    res = runner.invoke(app, ["simulate", "--scenario", str(p), "--router", "least-load,nearest"])
    assert res.exit_code == 2
    assert "nearest" in res.output and "Traceback" not in res.output
    with pytest.raises(ScenarioError, match="named twice"):
        scenario_from_mapping({**load_scenario(p).model_dump(by_alias=True),
                               "routers": ["most-free", "most-free"]})


def test_no_prefix_no_prefix_figures(tmp_path: Path) -> None:
    lines = [_line(1000 * i, 600, 10, []) for i in range(6)]
    p = _scenario(tmp_path, lines)
    res = runner.invoke(app, ["simulate", "--scenario", str(p), "--json-only"])
    assert res.exit_code == 0, res.output
    assert "prefix_cache" not in json.loads(res.output)["runs"][0]


def test_bad_trace_line_is_a_clean_cli_error(tmp_path: Path) -> None:
    p = _scenario(tmp_path, [_line(0, 600, 10, [1]), "{oops"])
    res = runner.invoke(app, ["simulate", "--scenario", str(p)])
    assert res.exit_code == 2
    said = " ".join(res.output.split())  # rich wraps the message
    assert "line 2: not JSON" in said and "Traceback" not in said


def _hosted(tmp_path: Path, host_tokens: int) -> Path:
    """One replica whose GPU KV (4,000 tokens) holds a turn or two, with a host tier beside."""
    p = _scenario(tmp_path, _conversations(), replicas=1)
    p.write_text(p.read_text() + "profile_overrides: {kv_capacity_tokens: 4000, "
                 f"host_kv_tokens: {host_tokens}}}\n")
    return p


def test_a_host_tier_gives_back_what_the_gpu_evicted(tmp_path: Path) -> None:
    gpu_only = run_scenario(prepare(load_scenario(_hosted(tmp_path, 0))))
    pc0 = gpu_only.runs[0].metrics["prefix_cache"]
    assert "host_share" not in pc0 and "host_hits" not in pc0["replicas"]["r0"]
    assert pc0["hit_rate"] < 0.5 * pc0["ideal_hit_rate"]  # turns come back to an evicted cache

    res = run_scenario(prepare(load_scenario(_hosted(tmp_path, 100_000))))
    pc = res.runs[0].metrics["prefix_cache"]
    r0 = pc["replicas"]["r0"]
    assert pc["hit_rate"] == pytest.approx(pc["ideal_hit_rate"])  # the host holds everything
    assert pc["hits_tokens"] == r0["hits"] + r0["host_hits"] == pc["host_hits_tokens"] + r0[
        "hits"]
    assert pc["host_share"] == pytest.approx(r0["host_hits"] / pc["hits_tokens"])
    assert pc["host_share"] > 0.5
    assert pc["prefill_tokens_computed"] == pc["prefill_tokens_offered"] - pc["hits_tokens"]
    assert pc["fleet_kv_tokens"] == 4000 + 100_000
    table = runner.invoke(app, ["simulate", "--scenario", str(_hosted(tmp_path, 100_000))])
    assert table.exit_code == 0, table.output
    assert "from host" in table.output and "GPU + host" in table.output
