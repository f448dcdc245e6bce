"""The CLI in an 80-column terminal: every flag and environment variable name in ``--help`` whole,
and ``qosgate config``'s tables with no cell cut and no column dropped."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import typer

from qosgate.cli import app
from tests.support.processes import QOSGATE

pytestmark = pytest.mark.e2e

COMMANDS = ("serve", "config", "top", "simulate", "simulate-embeddings")


def run80(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS="80", LINES="50")
    env.pop("QOSGATE_CONFIG", None)
    return subprocess.run([*QOSGATE, *args], capture_output=True, text=True, env=env,
                          timeout=60, check=False)


def command(name: str) -> Any:
    return typer.main.get_command(app).commands[name]  # type: ignore[attr-defined]


def whole(name: str, text: str) -> bool:
    """``name`` appears with nothing glued to either side (not cut, not a prefix of another)."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def names_of(cmd: Any) -> tuple[list[str], list[str]]:
    flags, envs = [], []
    for p in cmd.params:
        if p.param_type_name != "option":
            continue
        flags += [*p.opts, *p.secondary_opts]
        if p.envvar:
            envs += [p.envvar] if isinstance(p.envvar, str) else list(p.envvar)
    return flags, envs


@pytest.mark.parametrize("name", COMMANDS)
def test_help_at_80_columns_names_every_flag_and_env_var_whole(name: str) -> None:
    r = run80(name, "--help")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "…" not in out
    assert max(len(ln) for ln in out.splitlines()) <= 80
    flags, envs = names_of(command(name))
    assert flags
    cut = [f for f in flags if not whole(f, out)] + [e for e in envs if not whole(e, out)]
    assert not cut, f"not whole in `{name} --help` at 80 columns: {cut}\n{out}"


def test_serve_help_groups_its_flags_and_stays_short() -> None:
    out = run80("serve", "--help").stdout
    heads = [ln for ln in out.splitlines() if ln and not ln.startswith(" ") and
             ln.endswith(":")]
    assert heads == ["Options:", "Upstream engines (--upstream):",
                     "Several instances (--redis, --workers):",
                     "Built-in engine (without --upstream):"]
    assert len(out.splitlines()) < 150
    upstream = out[out.index("Upstream engines"):out.index("Several instances")]
    for flag in ("--upstream", "--upstream-capacity", "--upstream-polarity",
                 "--upstream-api-key"):
        assert whole(flag, upstream), flag


LONG_TENANTS = """
tenants:
  - name: acme-corporation-production
    tier: enterprise
    weight: 3
    api_keys: [sk-a, sk-b]
    allowed_classes: [realtime, api, batch]
    limits: {requests_per_minute: 6000, tokens_per_minute: 2000000, max_concurrent: 64}
  - {name: bob, tier: free, api_keys: [sk-c]}
"""


def test_config_tables_at_80_columns_cut_and_drop_nothing(tmp_path: Path) -> None:
    p = tmp_path / "q.yaml"
    p.write_text(LONG_TENANTS)
    r = run80("config", "--config", str(p))
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout
    assert "…" not in out
    assert max(len(ln) for ln in out.splitlines()) <= 80
    for head in ("class", "level", "strict", "weight", "TTFT budget", "queue timeout",
                 "max queue", "aging after", "preemptible", "can preempt", "tier",
                 "boost (levels)", "tenant", "keys", "allowed classes", "rpm", "tpm",
                 "max conc"):
        assert head in out, head
    for cell in ("acme-corporation-production", "realtime,api,batch", "300000 ms", "100000",
                 "6000", "enterprise", "offline"):
        assert cell in out, cell
    # a table too wide continues below, its key column repeated
    assert "service classes (policy: qos) (continued)" in out
    assert out.count("acme-corporation-production") == 2
