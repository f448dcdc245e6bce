"""``qosgate calibrate`` end to end against a live stand-in: the profile it writes, and a limit
it must be told. (The fit, the measurements' arithmetic and the probe in virtual time:
``tests/calibrate/test_calibrate.py``.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from qosgate.cli import app
from qosgate.models.simmodel import load_profile
from tests.support.calibration import COEFS, PROFILE
from tests.support.processes import Server, start_standin


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = start_standin(tmp_path_factory.mktemp("cal"), "--profile", PROFILE)
    yield s
    s.stop()


@pytest.mark.e2e
def test_calibrate_writes_a_profile_the_simulator_loads(standin: Server, tmp_path: Path) -> None:
    """The command against a live stand-in: probe, fit, table, a profile file with the engine's
    limits, model and source. The coefficients' accuracy is the virtual-time test's
    (``tests/calibrate/test_calibrate.py``)."""
    p = load_profile(PROFILE)
    out = tmp_path / "fitted.yaml"
    res = CliRunner().invoke(app, [
        "calibrate", f"127.0.0.1:{standin.port}", "--out", str(out), "--time-limit", "60",
        "--max-num-seqs", str(p.max_num_seqs),
        "--max-num-batched-tokens", str(p.max_num_batched_tokens),
        "--kv-capacity-tokens", str(p.kv_capacity_tokens), "--compare", PROFILE,
    ])
    assert res.exit_code == 0, res.output
    assert "measured vs modelled" in res.output
    fitted = load_profile(out)  # what `qosgate simulate --profile FILE` loads
    for c in COEFS:
        assert getattr(fitted, c) >= 0, c
    assert fitted.step_fixed_s > 0 and fitted.prefill_s_per_token > 0
    assert (fitted.max_num_seqs, fitted.max_num_batched_tokens, fitted.kv_capacity_tokens) == (
        p.max_num_seqs, p.max_num_batched_tokens, p.kv_capacity_tokens)
    assert fitted.model == p.model
    assert fitted.source.startswith("fitted by qosgate calibrate against http://127.0.0.1:")


@pytest.mark.e2e
def test_a_missing_limit_is_asked_for(standin: Server) -> None:
    """Not on a terminal, and the stand-in publishes no cache_config_info: the flag is named."""
    res = CliRunner().invoke(app, ["calibrate", f"127.0.0.1:{standin.port}"])
    assert res.exit_code == 2
    assert "--max-num-seqs" in res.output
