"""The embedded engine's start-up check (``runtime/preflight.py``): its runner against children
that abort, segfault, hang, fail or work, and what the gateway then says about each.

The real check (llama.cpp in the child) and ``qosgate serve`` around it are in
``tests/e2e/llama/test_preflight.py``.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from qosgate.runtime.preflight import FIX, ProbeResult, cpu_flags, explain, run_probe

# an AVX2 machine: no AVX-512, no AMX
CPU = frozenset({"pni", "sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "aes"})
INFO = "CPU : SSE3 = 1 | AVX2 = 1 | AVX512 = 1 | AMX_INT8 = 1 | OPENMP = 1"


def child(*lines: str) -> list[str]:
    """A Python child with faulthandler on, as the real check's child has it."""
    return [sys.executable, "-X", "faulthandler", "-c", "\n".join(lines)]


def says_system_info(info: str = INFO) -> str:
    return f"import json; print(json.dumps({{'system_info': {info!r}}}), flush=True)"


def test_an_aborting_child_is_named_by_its_signal_with_cause_and_fix() -> None:
    res = run_probe(child("import os", "os.abort()"), 60)
    assert res.killed_by == signal.SIGABRT
    assert not res.ok and not res.timed_out and res.error is None
    text = explain(res, CPU)
    assert text.startswith("qosgate: the embedded engine crashed in its start-up check")
    assert "killed by SIGABRT (Aborted)" in text
    assert "likely cause: llama.cpp stopped itself" in text and f"fix: {FIX}" in text
    assert "it died before it could say what it was built for" in text
    assert "Fatal Python error: Aborted" in text  # the child's own last words


def test_a_segfault_after_the_system_info_names_the_instructions_this_cpu_lacks() -> None:
    res = run_probe(child(says_system_info(), "import ctypes", "ctypes.string_at(0)"), 60)
    assert res.killed_by == signal.SIGSEGV and res.system_info == INFO
    text = explain(res, CPU)
    assert "killed by SIGSEGV (Segmentation fault)" in text
    assert "compiled for CPU instructions this machine cannot run" in text
    assert "AMX or AVX-512" in text
    assert "this CPU (/proc/cpuinfo): avx avx2 bmi2 f16c fma pni sse4_2" in text  # aes: not SIMD
    assert f"llama.cpp (its system info): {INFO}" in text
    assert "built to use AVX512, AMX_INT8, which this CPU does not list" in text
    assert "make clean && make serve" in text
    assert "scripts/llama_env.py install --python .venv/bin/python" in text
    assert "docs/guides/engine.md#building-llamacpp" in text
    assert "--no-preflight" in text
    assert "Fatal Python error: Segmentation fault" in text


def test_without_cpuinfo_the_message_still_names_cause_and_fix() -> None:
    res = run_probe(child(says_system_info(), "import os", "os.kill(os.getpid(), 4)"), 60)
    assert res.killed_by == signal.SIGILL
    text = explain(res, None)
    assert "killed by SIGILL" in text and "/proc/cpuinfo" not in text
    assert "which this CPU does not list" not in text  # nothing to compare with
    assert f"fix: {FIX}" in text


def test_a_hanging_child_is_stopped_at_the_timeout_which_says_so() -> None:
    res = run_probe(child("import time", "time.sleep(3600)"), 0.5)
    assert res.timed_out and res.returncode is None and res.killed_by is None and not res.ok
    text = explain(res, CPU)
    assert "did not finish within 0.5 s (engine.preflight_timeout_s)" in text
    assert "it was stopped" in text and "raise engine.preflight_timeout_s" in text


def test_a_child_that_works_is_ok_and_says_nothing() -> None:
    res = run_probe(child(says_system_info(), "print(json.dumps({'ok': 7}))"), 60)
    assert res.ok and res.tokens == 7 and res.returncode == 0 and res.system_info == INFO
    assert explain(res, CPU) == ""


def test_a_child_that_exits_zero_without_reporting_is_not_ok() -> None:
    res = run_probe(child("pass"), 60)
    assert res.returncode == 0 and not res.ok


def test_a_python_error_in_the_child_is_an_ordinary_start_up_error() -> None:
    res = run_probe(child(
        "import json, sys",
        "print(json.dumps({'error': 'model file not found: /x.gguf'}))",
        "sys.exit(1)",
    ), 60)
    assert res.error == "model file not found: /x.gguf" and res.killed_by is None
    assert "exited with status 1: model file not found: /x.gguf" in explain(res, CPU)


def test_output_that_is_not_a_report_is_skipped() -> None:
    out = "\n".join(["llama says hi", "{not json", json.dumps({"ok": 3})])
    assert ProbeResult(0, 0.1, out, "", 10).tokens == 3


def test_cpu_flags_of_x86_and_arm64_and_of_no_file(tmp_path: Path) -> None:
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 amx_tile\n\nprocessor\t: 1\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve i8mm\n")
    assert cpu_flags(x86) == {"fpu", "sse2", "avx2", "amx_tile"}
    assert cpu_flags(arm) == {"fp", "asimd", "sve", "i8mm"}
    assert cpu_flags(tmp_path / "none") is None
