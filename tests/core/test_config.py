from pathlib import Path

import pytest

from qosgate.config import ConfigError, default_config, load_config


def test_defaults_reproduce_the_seeds() -> None:
    cfg = default_config()
    assert [c.name for c in cfg.classes] == ["realtime", "api", "batch", "offline"]
    assert [c.level for c in cfg.classes] == [0, 1, 2, 3]
    weights = {c.name: c.weight for c in cfg.classes}
    assert (weights["api"], weights["batch"], weights["offline"]) == (5, 3, 2)
    aging = {c.name: c.aging_after_s for c in cfg.classes}
    assert (aging["api"], aging["batch"], aging["offline"]) == (10, 30, 60)
    boosts = {t.name: t.boost for t in cfg.tiers}
    assert boosts["enterprise"] == boosts["vip"] == -1
    assert boosts["free"] == boosts["basic"] == 1
    assert cfg.classes[0].strict and cfg.policy == "qos"


def test_yaml_with_tenants_and_defaults_for_the_rest(tmp_path: Path) -> None:
    p = tmp_path / "q.yaml"
    p.write_text(
        """
policy: wfq
server: {port: 9000}
tenants:
  - name: acme
    tier: enterprise
    api_keys: [k-acme]
    limits: {requests_per_minute: 600, max_concurrent: 8}
  - name: hobby
    tier: free
    api_keys: [k-hobby]
    allowed_classes: [batch, offline]
"""
    )
    cfg = load_config(p)
    assert cfg.policy == "wfq"
    assert [t.name for t in cfg.tenants] == ["acme", "hobby"]
    assert cfg.tenants[0].limits.max_concurrent == 8
    assert len(cfg.classes) == 4


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("tenants: [{name: a, tier: gold}]", "unknown tier 'gold'"),
        ("tenants: [{name: a, allowed_classes: [premium]}]", "unknown class 'premium'"),
        (
            "tenants: [{name: a, api_keys: [k]}, {name: b, api_keys: [k]}]",
            "used by another tenant",
        ),
        ("polcy: qos", "polcy"),
        ("policy: lifo", "policy"),
        (
            "classes: [{name: a, level: 0, ttft_budget_ms: 1, queue_timeout_s: 1, max_queue: 1},"
            " {name: b, level: 2, ttft_budget_ms: 1, queue_timeout_s: 1, max_queue: 1}]",
            "levels must be 0..1",
        ),
        ("[1, 2]", "must be a mapping"),
        ("a: [", "not valid YAML"),
    ],
)
def test_invalid_configs_say_what_is_wrong(tmp_path: Path, text: str, fragment: str) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_config(p)
    assert fragment in str(exc.value)


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "nope.yaml")
