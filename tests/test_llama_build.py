"""The embedded engine's llama.cpp build (``scripts/llama_env.py``) runs on any x86-64 machine.

The checks read the *binary*, not this machine's CPU: a native build made on an AVX-512 or AMX
machine fails here wherever the suite runs, and a library compiled here with AMX or AVX-512
instructions (never executed) shows that the check finds them.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.files import load_module

ROOT = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                                reason="the instruction-set check is for x86-64 builds")


LE = load_module("scripts/llama_env.py")


def _need(what: str, have: object) -> None:
    """Missing tools fail the run in CI (the install is broken) and skip elsewhere."""
    if not have:
        if IN_CI:
            pytest.fail(f"{what} is missing")
        pytest.skip(f"{what} is missing")


@pytest.mark.slow
def test_the_installed_engine_holds_no_instruction_above_the_portable_baseline() -> None:
    spec = importlib.util.find_spec("llama_cpp")
    _need("llama_cpp (the embedded extra)", spec)
    _need("objdump (binutils)", shutil.which("objdump"))
    assert spec is not None and spec.origin is not None
    libs = LE.libraries(Path(spec.origin).parent)
    assert any("ggml-cpu" in p.name for p in libs), libs  # the kernels are where we look
    found = [LE.check_library(p) for p in libs]
    bad = [f.summary() for f in found if not f.portable]
    assert not bad, ("llama.cpp was built with instructions above the portable baseline; "
                     "rebuild it: python3 scripts/llama_env.py install --python "
                     f"{sys.executable}\n" + "\n".join(bad))


def test_the_engine_reports_the_portable_instruction_sets_at_load() -> None:
    """What llama.cpp itself says it was compiled for: AVX2 on, AVX-512 and AMX off."""
    _need("llama_cpp (the embedded extra)", importlib.util.find_spec("llama_cpp"))
    import llama_cpp

    info = llama_cpp.llama_print_system_info().decode()
    assert "AVX2 = 1" in info, info
    for off in ("AVX512 = 1", "AVX512_VNNI = 1", "AVX512_BF16 = 1", "AMX_INT8 = 1",
                "AVX_VNNI = 1"):
        assert off not in info, info


SOURCES = {
    "amx": ("-mamx-tile", """#include <immintrin.h>
void tiles(const void *cfg, const void *src, void *dst) {
    _tile_loadconfig(cfg); _tile_loadd(0, src, 64); _tile_stored(0, dst, 64); _tile_release();
}"""),
    "avx512": ("-mavx512f", """#include <immintrin.h>
void add(float *a, const float *b) {
    _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(b)));
}"""),
    "avx512vl": ("-mavx512f -mavx512vl", """#include <immintrin.h>
void tern(int *a, const int *b, const int *c) {  /* EVEX on 256-bit registers: no zmm */
    __m256i x = _mm256_ternarylogic_epi32(_mm256_loadu_si256((const __m256i *)a),
        _mm256_loadu_si256((const __m256i *)b), _mm256_loadu_si256((const __m256i *)c), 0x96);
    _mm256_storeu_si256((__m256i *)a, x);
}"""),
    "avx2": ("-mavx2 -mfma -mf16c", """#include <immintrin.h>
void fma8(float *a, const float *b) {
    __m256 x = _mm256_loadu_ps(a);
    _mm256_storeu_ps(a, _mm256_fmadd_ps(x, _mm256_loadu_ps(b), x));
}"""),
}


def _compile(tmp: Path, name: str) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    _need("a C compiler", cc)
    flags, code = SOURCES[name]
    (tmp / f"{name}.c").write_text(code)
    out = tmp / f"lib{name}.so"
    res = subprocess.run([str(cc), "-O2", "-shared", "-fPIC", *flags.split(),
                          str(tmp / f"{name}.c"), "-o", str(out)], capture_output=True, text=True)
    if res.returncode != 0 and "unrecognized" in res.stderr:  # an old compiler
        pytest.skip(f"the compiler cannot emit {name}: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("name", "what"), [("amx", "amx"), ("avx512", "evex"),
                                            ("avx512vl", "evex")])
def test_the_check_finds_instructions_above_the_baseline(tmp_path: Path, name: str,
                                                        what: str) -> None:
    _need("objdump (binutils)", shutil.which("objdump"))
    found = LE.check_library(_compile(tmp_path, name))
    assert not found.portable
    assert getattr(found, what) > 0, found.summary()
    assert "NOT portable" in found.summary()
    # and the command says so with its exit status
    assert LE.check([str(tmp_path / f"lib{name}.so")], None) == 1


def test_avx2_and_fma_are_inside_the_baseline(tmp_path: Path) -> None:
    _need("objdump (binutils)", shutil.which("objdump"))
    found = LE.check_library(_compile(tmp_path, "avx2"))
    assert found.portable, found.summary()


def test_the_scan_reads_evex_by_its_prefix_not_by_register_names() -> None:
    lines = [
        "    1000:\t62 f1 fd 28 6f 05 10 00 00 00 \tvmovdqa64 0x10(%rip),%ymm0",  # EVEX, ymm
        "    100a:\t67 62 f1 7c 48 58 c1 \tvaddps %zmm1,%zmm0,%zmm0",  # after a prefix
        "    1011:\tc5 fd 6f 05 10 00 00 00 \tvmovdqa 0x10(%rip),%ymm0",  # VEX: baseline
        "    1019:\tc4 e2 78 49 07       \tldtilecfg (%rdi)",
        "    101e:\tc4 e2 7d 50 c1       \t{vex} vpdpbusd %ymm1,%ymm0,%ymm0",
        "    1023:\t62                   \t(bad)",  # data in .text: not an instruction
        "Disassembly of section .text:",
    ]
    found = LE.scan_disassembly(lines, "x.so")
    assert (found.evex, found.amx, found.vex_vnni) == (2, 1, 1)


def test_a_changed_flag_set_is_a_new_build_and_the_version_is_the_projects_pin() -> None:
    version = LE.pinned_version()
    portable, native = LE.Recipe(version, native=False), LE.Recipe(version, native=True)
    assert portable.directory() != native.directory()
    assert "-DGGML_NATIVE=OFF" in portable.cmake_args
    assert {"-DGGML_AVX512=OFF", "-DGGML_AMX_INT8=OFF"} <= set(portable.cmake_args)
    assert version in portable.directory().name
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"llama-cpp-python=={version}"' in pyproject
