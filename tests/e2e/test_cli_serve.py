"""``qosgate serve``'s start-up: upstream options with no upstream are refused, not ignored, and the
banner gives an adaptive window's start and cap."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import QOSGATE, Server, start_gateway, start_standin

pytestmark = pytest.mark.e2e


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("QOSGATE_")}
    return subprocess.run([*QOSGATE, "serve", "--port", "0", *args], capture_output=True,
                          text=True, timeout=60, env={**e, **(env or {})}, check=False)


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--upstream-capacity", "8"], {}, ["--upstream-capacity"]),
        (["--upstream-polarity", "vllm", "--upstream-api-key", "k"], {},
         ["--upstream-polarity", "--upstream-api-key"]),
        ([], {"QOSGATE_UPSTREAM_CAPACITY": "8"}, ["QOSGATE_UPSTREAM_CAPACITY"]),
    ],
)
def test_upstream_options_without_an_upstream_are_a_usage_error(
        args: list[str], env: dict[str, str], named: list[str]) -> None:
    r = serve("--engine", "sim", *args, env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr
    assert "Error:" in err and "--upstream URL" in err
    for n in named:
        assert n in err, err
    assert "serving on" not in r.stdout


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_standin(tmp_path_factory.mktemp("standin"))
    yield s
    s.stop()


def banner_line(gw: Server, replica: str) -> str:
    return next(ln for ln in gw.log.read_text().splitlines() if f"replica {replica}:" in ln)


def test_banner_gives_an_adaptive_windows_start_and_cap(standin: Server, tmp_path: Path) -> None:
    gw = start_gateway(tmp_path, "--upstream", standin.url, "--upstream-capacity", "48")
    try:
        line = banner_line(gw, "upstream-0")
    finally:
        gw.stop()
    assert standin.url in line
    assert line.endswith("window adaptive: starts at 8, at most 48"), line


def test_banner_of_an_upstream_from_the_config_with_flags(standin: Server,
                                                         tmp_path: Path) -> None:
    """Upstream options apply to the config's upstreams: not refused; a fixed window is one
    number."""
    cfg = tmp_path / "q.yaml"
    cfg.write_text(f"fleet: {{window: {{mode: fixed}}}}\nupstreams: [{{url: {standin.url}}}]\n")
    gw = start_gateway(tmp_path, "--config", str(cfg), "--upstream-capacity", "5")
    try:
        line = banner_line(gw, "upstream-0")
    finally:
        gw.stop()
    assert line.endswith("window 5"), line


def test_sim_capacity_is_a_deprecated_alias_of_window(tmp_path: Path) -> None:
    """``--window`` owns the in-process engine's window; ``--sim-capacity``, its old name for
    sim, still sets it (with a warning) unless ``--window`` is given too."""
    for args, window in ((["--sim-capacity", "3"], "3"),
                         (["--sim-capacity", "3", "--window", "5"], "5")):
        gw = start_gateway(tmp_path, "--engine", "sim", *args)
        try:
            log = gw.log.read_text()
        finally:
            gw.stop()
        assert "--sim-capacity is deprecated: use --window" in log, log
        line = next(ln for ln in log.splitlines() if "window" in ln and "replica" in ln)
        assert f"window {window}" in line, line


def test_a_renamed_flag_warns_and_a_bad_value_names_its_key(tmp_path: Path) -> None:
    """``--upstream-capacity`` still works, saying to use ``--max-window``; a value the settings
    refuse exits 2 naming the key (before any port is bound)."""
    r = subprocess.run([*QOSGATE, "serve", "--upstream", "http://127.0.0.1:9",
                        "--upstream-capacity", "0"], capture_output=True, text=True,
                       timeout=60, check=False, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "--upstream-capacity is deprecated: use --max-window" in r.stderr
    assert "upstreams.0.max_window" in r.stdout
