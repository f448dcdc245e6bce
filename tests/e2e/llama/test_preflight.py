"""A native crash of the embedded engine is never a silent death of ``qosgate serve``.

In its start-up check (``runtime/preflight.py``) the gateway exits before it serves, naming the
signal, the cause and the fix; after start (the check passed), faulthandler leaves "Fatal Python
error" and every thread's stack in the gateway's log. The crash is a test double on
``PYTHONPATH`` (``crash_site/sitecustomize.py``): llama.cpp's decode calls ``os.abort()`` in the
process ``QOSGATE_TEST_ABORT_IN`` names. A serve that starts normally is
``test_serve.py``'s, whose banner shows the check passed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
from pathlib import Path

import openai
import pytest

from qosgate.runtime.preflight import preflight
from qosgate.settings import EngineSettings
from tests.support.llama import MODEL, Serve
from tests.support.ports import free_port
from tests.support.processes import gateway_args

CRASH_SITE = Path(__file__).parent / "crash_site"
SMALL = ("--n-ctx", "256", "--threads", "2")


def test_the_check_decodes_with_the_real_engine_and_reports_its_build() -> None:
    res = preflight(EngineSettings(n_ctx=256, n_threads=2))
    assert res.ok, res.stderr
    assert res.tokens >= 2  # two sequences, each at least its first token
    assert res.system_info is not None and res.system_info.startswith("CPU : ")


@pytest.mark.e2e
def test_a_crash_in_the_check_stops_serve_before_it_serves(tmp_path: Path) -> None:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(CRASH_SITE), QOSGATE_TEST_ABORT_IN="preflight",
               COLUMNS="200", XDG_STATE_HOME=str(tmp_path))
    proc = subprocess.Popen(gateway_args(port, *SMALL), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    answered = 0
    try:
        while proc.poll() is None:  # the port never accepts a connection, until the exit
            with contextlib.suppress(OSError), socket.create_connection(
                ("127.0.0.1", port), timeout=1
            ):
                answered += 1
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.05)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, out + err
    assert answered == 0 and "serving on" not in out, out
    assert "the embedded engine crashed in its start-up check" in err, err
    assert "killed by SIGABRT (Aborted)" in err
    assert "likely cause:" in err and "fix: rebuild llama-cpp-python" in err
    assert "docs/guides/engine.md#building-llamacpp" in err
    assert "llama.cpp (its system info): CPU : " in err  # it said so before the decode
    assert "Fatal Python error: Aborted" in err
    assert re.search(r'File ".*llamacpp\.py", line \d+ in step', err), err


@pytest.mark.e2e
def test_no_preflight_skips_the_check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same crashing double in the check's child: without the check the gateway serves."""
    monkeypatch.setenv("PYTHONPATH", str(CRASH_SITE))
    monkeypatch.setenv("QOSGATE_TEST_ABORT_IN", "preflight")
    s = Serve(tmp_path / "serve.log", *SMALL, "--no-preflight")
    try:
        log = s.log.read_text()
        assert "serving on" in log and "start-up check" not in log, log
    finally:
        assert s.stop() == 0


@pytest.mark.e2e
def test_a_crash_after_start_leaves_every_threads_stack_in_the_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(CRASH_SITE))
    monkeypatch.setenv("QOSGATE_TEST_ABORT_IN", "gateway")
    s = Serve(tmp_path / "serve.log", *SMALL)
    try:
        assert "start-up check passed" in s.log.read_text()
        with pytest.raises(openai.APIConnectionError):
            s.client().chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert s.proc.wait(60) == -signal.SIGABRT
    finally:
        s.stop()
    log = s.log.read_text()
    assert "Fatal Python error: Aborted" in log, log
    assert re.search(r'File ".*llamacpp\.py", line \d+ in step', log), log
    assert len(re.findall(r"^(?:Current thread|Thread) 0x[0-9a-f]+", log, re.M)) >= 2, log
