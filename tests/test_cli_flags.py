"""Flags as config keys (``qosgate/flags.py``, ``sim/flags.py``): the tables, the one function
that sets their keys, the config file read once, and the renamed keys and flags that still work
with a warning naming the new spelling."""

from __future__ import annotations

import inspect
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from qosgate.cli import serve
from qosgate.config import ConfigError, QosConfig
from qosgate.flags import SERVE_FLAGS, UNSET, Flag, flag_keys, set_keys
from qosgate.replay.cli import replay_command
from qosgate.settings import GatewaySettings, load_gateway
from qosgate.sim.cli import simulate_command
from qosgate.sim.flags import REPLAY_FLAGS, SIMULATE_FLAGS, with_keys
from qosgate.sim.scenario_file import Scenario, load_scenario

# serve's parameters that set no gateway setting: the file itself, the QoS side, the processes
NOT_SETTINGS = {"ctx", "config", "policy", "api_key", "workers"}


def params(command: Any) -> set[str]:
    return set(inspect.signature(command).parameters)


def key_exists(model: type[BaseModel], key: str) -> bool:
    """``key`` (dotted, ``name[]`` for a list's entries) names a field of ``model``'s tree."""
    node: Any = model
    for part in key.split("."):
        fields = getattr(node, "model_fields", None)
        if fields is None or part.removesuffix("[]") not in fields:
            return False
        ann = fields[part.removesuffix("[]")].annotation
        args = [a for a in getattr(ann, "__args__", ()) if a is not Ellipsis]
        node = args[0] if part.endswith("[]") or (args and hasattr(args[0], "model_fields")) \
            else ann
    return True


# ---------------------------------------------------------------- the override function
def test_flag_keys_sets_the_given_flags_converted_in_table_order() -> None:
    table = (
        Flag("a", "x.a"),
        Flag("b", "x.b", lambda v: v * 2),
        Flag("c", "x.c", lambda v: UNSET),
        Flag("d", "y", also={"z": None}),
    )
    assert flag_keys(table, {"a": 1, "b": 3, "c": 5, "d": "on"}) == {
        "x.a": 1, "x.b": 6, "y": "on", "z": None}
    assert flag_keys(table, {"a": None, "b": None}) == {}


def test_a_renamed_flag_warns_sets_its_key_and_the_new_one_wins() -> None:
    table = (Flag("new", "k"), Flag("old", "k", renamed_to="new"))
    told: list[tuple[str, str]] = []
    assert flag_keys(table, {"old": 3}, lambda o, n: told.append((o, n))) == {"k": 3}
    assert told == [("old", "new")]
    assert flag_keys(table, {"old": 3, "new": 5}, lambda o, n: None) == {"k": 5}


def test_set_keys_makes_the_path_sets_every_list_entry_and_leaves_the_input() -> None:
    data = {"server": {"port": 1}, "upstreams": [{"url": "a"}, {"url": "b"}]}
    out = set_keys(data, {"server.host": "h", "upstreams[].max_window": 4, "engine.kind": "sim"})
    assert out == {"server": {"port": 1, "host": "h"},
                   "upstreams": [{"url": "a", "max_window": 4}, {"url": "b", "max_window": 4}],
                   "engine": {"kind": "sim"}}
    assert data == {"server": {"port": 1}, "upstreams": [{"url": "a"}, {"url": "b"}]}
    assert set_keys({}, {"upstreams[].max_window": 4}) == {"upstreams": []}


def test_a_list_flag_comes_before_the_keys_of_its_entries() -> None:
    values = {"upstream": "http://a, http://b", "max_window": 7, "upstream_polarity": "vllm"}
    out = set_keys({"upstreams": [{"url": "http://old"}]}, flag_keys(SERVE_FLAGS, values))
    assert out["upstreams"] == [
        {"url": u, "max_window": 7, "priority_polarity": "vllm"}
        for u in ("http://a", "http://b")]


# ---------------------------------------------------------------- the tables
def test_serve_flags_name_serve_parameters_and_gateway_settings() -> None:
    table = {f.param for f in SERVE_FLAGS}
    assert table - {"reuse_port"} <= params(serve)
    assert params(serve) - table == NOT_SETTINGS  # every other flag is a setting's
    for f in SERVE_FLAGS:
        assert key_exists(GatewaySettings, f.key), f.key


def test_simulate_and_replay_flags_name_their_parameters_and_scenario_keys() -> None:
    for table, command in ((SIMULATE_FLAGS, simulate_command), (REPLAY_FLAGS, replay_command)):
        for f in table:
            assert f.param in params(command), f.param
            # a scenario's config is a qosgate config
            model, key = ((QosConfig, f.key.removeprefix("config.")) if f.key.startswith("config.")
                          else (Scenario, f.key))
            assert key_exists(model, key), f.key


def test_scenario_keys_from_flags() -> None:
    sc = load_scenario("seed-classes")
    new = with_keys(sc, flag_keys(SIMULATE_FLAGS, {
        "seed": 9, "load": 0.5, "gateways": "1,2", "spread": "hash", "router": "cache-aware",
        "prefill_budget": "off"}))
    assert new.seed == 9
    assert new.arrivals.load == 0.5 and new.arrivals.rate is None and new.sweep is None
    assert new.gateways.counts == (1, 2) and new.gateways.spread == "hash"
    assert new.config["fleet"]["router"] == "cache-aware"
    assert new.config["fleet"]["prefill_budget_tokens"] is None
    assert with_keys(sc, flag_keys(SIMULATE_FLAGS, {"router": "least-load,most-free"})
                     ).routers == ("least-load", "most-free")
    assert with_keys(sc, {}) is sc


# ---------------------------------------------------------------- one read
def test_the_config_file_is_read_once_for_both_schemas(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    p = tmp_path / "q.yaml"
    p.write_text("policy: wfq\nserver: {port: 9001}\nupstreams: [{url: http://a:1}]\n")
    reads: list[Path] = []
    read_text = Path.read_text

    def counted(self: Path, *args: Any, **kwargs: Any) -> str:
        reads.append(self)
        return read_text(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counted)
    cfg, settings = load_gateway(p, {"server.host": "0.0.0.0", "upstreams[].max_window": 3})
    assert reads == [p]
    assert cfg.policy == "wfq"
    assert (settings.server.host, settings.server.port) == ("0.0.0.0", 9001)
    assert settings.upstreams[0].max_window == 3


def test_a_bad_flag_value_is_named_by_its_key() -> None:
    with pytest.raises(ConfigError, match=r"server\.port"):
        load_gateway(None, {"server.port": 70000})


# ---------------------------------------------------------------- renamed keys
@pytest.mark.parametrize(("text", "old", "new", "read"), [
    ("upstreams: [{url: 'http://a:1', capacity: 5}]", "upstreams[].capacity",
     "upstreams[].max_window", lambda s: s.upstreams[0].max_window == 5),
    ("engine: {kind: sim, capacity: 3}", "engine.capacity", "engine.max_window",
     lambda s: s.engine.max_window == 3),
    ("embeddings: {window: off}", "embeddings.window", "embeddings.linger",
     lambda s: s.embeddings.linger == "off"),
    ("embeddings: {linger: fixed, window_ms: 20}", "embeddings.window_ms",
     "embeddings.linger_ms", lambda s: s.embeddings.linger_ms == 20),
])
def test_an_old_key_is_read_with_a_warning_naming_the_new(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str, old: str, new: str,
        read: Any) -> None:
    p = tmp_path / "q.yaml"
    p.write_text(text + "\n")
    with caplog.at_level(logging.WARNING, logger="qosgate.settings"):
        _, settings = load_gateway(p)
    assert read(settings)
    assert f"{old} is deprecated: use {new}" in caplog.text


def test_an_old_key_beside_its_new_one_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "q.yaml"
    p.write_text("engine: {capacity: 3, max_window: 4}\n")
    with pytest.raises(ConfigError, match=re.escape(
            "engine.capacity is the old name of engine.max_window: give max_window alone")):
        load_gateway(p)


def test_config_prints_the_engines_serve_would_run_with_the_same_file_and_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file without ``upstreams:`` meant for ``serve --upstream``: ``qosgate config`` with the
    same flag (or its environment variable) shows the upstream, not the built-in engine."""
    from typer.testing import CliRunner

    from qosgate.cli import app

    p = tmp_path / "qos.yaml"
    p.write_text("tenants: [{name: acme, api_keys: [sk-a]}]\n")
    monkeypatch.delenv("QOSGATE_UPSTREAM", raising=False)
    runner = CliRunner()
    out = runner.invoke(app, ["config", "--config", str(p), "--upstream", "http://10.0.0.5:8001"],
                        env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "upstream upstream-0: http://10.0.0.5:8001" in out.output
    assert "engine:" not in out.output
    out = runner.invoke(app, ["config", "--config", str(p)],
                        env={"COLUMNS": "200", "QOSGATE_UPSTREAM": "http://10.0.0.6:8001"})
    assert "upstream upstream-0: http://10.0.0.6:8001" in out.output
    out = runner.invoke(app, ["config", "--config", str(p)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    assert "engine: llamacpp, built in" in out.output and "upstream " not in out.output


def test_config_prints_the_models_weights_and_the_limits_on_one_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The weights resolved as ``serve`` starts with them (a profile's from the profiles), the
    tenants' limits on one model; a profile that does not load is an error (exit 2)."""
    from typer.testing import CliRunner

    from qosgate.cli import app
    from qosgate.models.simmodel import load_profile
    from qosgate.models.token_times import token_times

    monkeypatch.delenv("QOSGATE_UPSTREAM", raising=False)
    p = tmp_path / "qos.yaml"
    p.write_text("""
fairness: {reference_model: small}
models:
  - {name: small, profile: qwen2.5-7b-instruct-h100}
  - {name: big, profile: llama-3-8b-a100}
  - {name: sql, base: big, load_cost: 200}
tenants:
  - {name: acme, api_keys: [sk-a], limits: {models: {big: {requests_per_minute: 5}}}}
""")
    runner = CliRunner()
    out = runner.invoke(app, ["config", "--config", str(p)], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    small = token_times(load_profile("qwen2.5-7b-instruct-h100"))
    big = token_times(load_profile("llama-3-8b-a100"))
    row = next(line.split() for line in out.output.splitlines() if line.startswith("│ big "))
    # the cells: model, prompt, output, where from (between the │ separators)
    assert row[3] == f"{big.prefill_s / small.prefill_s:.3g}"
    assert row[5] == f"{big.decode_s / small.decode_s:.3g}" and row[7] == "profile"
    sql = next(line.split() for line in out.output.splitlines() if line.startswith("│ sql "))
    assert sql[3:6] == row[3:6] and "200" in sql
    assert any(line.split()[1:6] == ["acme", "│", "big", "│", "5"]
               for line in out.output.splitlines() if line.startswith("│ acme"))
    p.write_text("models: [{name: small, profile: no-such-profile}]\n")
    out = runner.invoke(app, ["config", "--config", str(p)], env={"COLUMNS": "200"})
    assert out.exit_code == 2 and "models:" in out.output
