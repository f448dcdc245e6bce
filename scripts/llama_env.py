#!/usr/bin/env python3
"""The embedded engine's llama.cpp, built once per machine so that it runs on any x86-64 machine.

Standard library only, so that any Python >= 3.11 runs it before the project's ``.venv`` exists.

    python3 scripts/llama_env.py install --python .venv/bin/python   # build (cached), install
    python3 scripts/llama_env.py build        # only the wheel, into the cache
    python3 scripts/llama_env.py check [LIB ...] [--python PY]   # is a build portable?
    python3 scripts/llama_env.py info         # the flags, the cache path, the stamp, as JSON

Why this exists: ``pip install llama-cpp-python`` compiles llama.cpp with ``GGML_NATIVE``, i.e.
``-march=native``. The library then uses every instruction the *build* machine advertises, AMX
tiles and AVX-512 included. On a CPU that advertises AMX where the tile state cannot be used
(some virtual machines), the first matrix product faults at ``ldtilecfg`` and takes the whole
gateway down; a wheel built on an AVX-512 machine dies with SIGILL on one without. And pip's
wheel cache keys a built wheel on the source archive alone, so a native wheel built once is
reused silently whatever flags are set later.

So the build here is explicit:

- **portable** (the default): ``GGML_NATIVE=OFF`` with the x86-64-v3 instruction sets named one
  by one (AVX, AVX2, FMA, F16C, BMI2; every CPU since 2013-2015 and every x86 cloud machine of
  today has them), and AVX-512, AVX-VNNI and AMX off;
- **native** (``--native`` or ``QOSGATE_LLAMA_NATIVE=1``): ``GGML_NATIVE=ON``, for a user who
  builds on the machine that will run it and accepts that the result runs nowhere else.

The wheel is built with pip's cache off into
``${QOSGATE_CACHE:-~/.cache/qosgate}/llama-cpp-python-<version>-<flavour>-<key>/``, where the key
hashes the version, the CMake flags and this recipe: a changed flag set is a new directory and a
new build, never a reused one. ``install`` puts that wheel into a virtual environment, replacing
whatever build was there, and leaves a marker there so the next run is a stamp check.

A portable wheel is checked before it is cached (``check``): its shared libraries are
disassembled with ``objdump`` and must hold no AMX instruction and no EVEX-encoded (AVX-512)
one. The same check runs in the test suite against the installed engine.

Environment: ``QOSGATE_CACHE`` (cache root), ``QOSGATE_LLAMA_NATIVE=1`` (the native build),
``QOSGATE_LLAMA_JOBS`` (parallel compile jobs; default: the CPU count).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "llama-cpp-python"
# bump when the build steps change: a stamp of another recipe is rebuilt
RECIPE = 1

# x86-64-v3, named one by one; everything above it off (ggml's defaults change between versions)
PORTABLE_FLAGS = (
    "-DGGML_NATIVE=OFF",
    "-DGGML_SSE42=ON", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
    "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF",
    "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
    "-DGGML_CPU_ALL_VARIANTS=OFF", "-DGGML_BACKEND_DL=OFF",
)
NATIVE_FLAGS = ("-DGGML_NATIVE=ON",)
PORTABLE_BASELINE = "x86-64-v3 (SSE4.2, AVX, AVX2, FMA, F16C, BMI2; no AVX-512, AVX-VNNI or AMX)"


def say(msg: str) -> None:
    print(f"[llama-env] {msg}", flush=True)


def pinned_version(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The one version of llama-cpp-python the project uses: its ``embedded`` extra's pin."""
    data = tomllib.loads(pyproject.read_text())
    for req in data["project"]["optional-dependencies"]["embedded"]:
        m = re.fullmatch(rf"\s*{re.escape(PACKAGE)}\s*==\s*([\w.]+)\s*", req)
        if m:
            return m.group(1)
    raise SystemExit(f"pyproject.toml: the embedded extra pins no {PACKAGE}==VERSION")


def native_requested(flag: bool) -> bool:
    env = os.environ.get("QOSGATE_LLAMA_NATIVE", "").strip().lower()
    return flag or env in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Recipe:
    version: str
    native: bool

    @property
    def flavour(self) -> str:
        return "native" if self.native else "portable"

    @property
    def cmake_args(self) -> tuple[str, ...]:
        return NATIVE_FLAGS if self.native else PORTABLE_FLAGS

    def key(self) -> dict[str, Any]:
        return {"recipe": RECIPE, "package": PACKAGE, "version": self.version,
                "cmake_args": list(self.cmake_args), "machine": platform.machine()}

    def digest(self) -> str:
        blob = json.dumps(self.key(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def directory(self) -> Path:
        root = os.environ.get("QOSGATE_CACHE") or str(Path.home() / ".cache" / "qosgate")
        name = f"{PACKAGE}-{self.version}-{self.flavour}-{self.digest()}"
        return Path(root).expanduser() / name


# ---------------------------------------------------------------------------- the check
# AMX: the tile configuration, loads, stores and dot products (objdump's mnemonics)
_AMX = re.compile(r"^(ldtilecfg|sttilecfg|tileloadd|tileloaddt1|tilestored|tilerelease|tilezero"
                  r"|tdp\w+|tcmm\w+)$")
_LEGACY_PREFIXES = {0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65, 0x66, 0x67, 0xF0, 0xF2, 0xF3}
_LINE = re.compile(r"^\s*[0-9a-f]+:\t((?:[0-9a-f]{2} )+)\s*\t?(\S*)")


@dataclass
class Findings:
    """What a library holds above the portable baseline: instruction counts and examples."""

    path: str
    amx: int = 0
    evex: int = 0  # AVX-512 (every EVEX-encoded instruction)
    vex_vnni: int = 0  # AVX-VNNI: VEX-encoded vpdp* dot products
    examples: list[str] = field(default_factory=list)

    @property
    def portable(self) -> bool:
        return not (self.amx or self.evex or self.vex_vnni)

    def summary(self) -> str:
        if self.portable:
            return f"{self.path}: portable ({PORTABLE_BASELINE})"
        parts = [f"{n} {what}" for n, what in ((self.amx, "AMX"), (self.evex, "AVX-512 (EVEX)"),
                                               (self.vex_vnni, "AVX-VNNI")) if n]
        return (f"{self.path}: NOT portable: {', '.join(parts)} instructions, e.g. "
                + "; ".join(self.examples[:4]))


def scan_disassembly(lines: Iterable[str], path: str) -> Findings:
    """Classify ``objdump -d`` output (raw bytes shown). EVEX is recognised by its prefix byte
    (0x62 after any legacy prefix: in 64-bit mode that byte is always EVEX), not by register
    names, so AVX-512VL code on xmm/ymm registers is found too."""
    found = Findings(path)
    for line in lines:
        m = _LINE.match(line)
        if not m or not m.group(2):  # a continuation line of a long instruction's bytes
            continue
        raw = [int(b, 16) for b in m.group(1).split()]
        mnemonic = m.group(2)
        i = 0
        while i < len(raw) and raw[i] in _LEGACY_PREFIXES:
            i += 1
        text = line.split("\t")[-1].strip()
        if _AMX.match(mnemonic):
            found.amx += 1
        elif i < len(raw) and raw[i] == 0x62 and mnemonic != "(bad)":
            found.evex += 1
        elif mnemonic == "{vex}" or (mnemonic.startswith("vpdp") and raw[i:i + 1] in ([0xC4],
                                                                                     [0xC5])):
            found.vex_vnni += 1
        else:
            continue
        if len(found.examples) < 8:
            found.examples.append(text)
    return found


def check_library(path: Path) -> Findings:
    objdump = shutil.which("objdump")
    if objdump is None:
        raise SystemExit("objdump not found (Debian package binutils): it checks the build")
    proc = subprocess.Popen([objdump, "-d", "--wide", str(path)], stdout=subprocess.PIPE,
                            text=True, errors="replace")
    assert proc.stdout is not None
    found = scan_disassembly(proc.stdout, str(path))
    if proc.wait() != 0:
        raise SystemExit(f"objdump -d {path} exited {proc.returncode}")
    return found


def libraries(where: Path) -> list[Path]:
    """The shared libraries of an installed ``llama_cpp`` package (or any folder), each content
    once (a wheel holds ``libggml-cpu.so``, ``.so.0`` and ``.so.0.25.3`` as three copies)."""
    seen: dict[str, Path] = {}
    for p in sorted(where.rglob("*.so*"), key=lambda p: (len(p.name), p.name)):
        if p.is_file() and not p.is_symlink():
            seen.setdefault(hashlib.sha256(p.read_bytes()).hexdigest(), p)
    return sorted(seen.values())


def installed_package_dir(python: str) -> Path:
    out = subprocess.check_output(
        [python, "-c", "import importlib.util as u; print(u.find_spec('llama_cpp').origin)"],
        text=True)
    return Path(out.strip()).parent


# ---------------------------------------------------------------------------- build, install
@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """One builder of a recipe at a time on the machine (two clones running ``make`` at once)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with (directory.parent / f"{directory.name}.lock").open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def read_stamp(recipe: Recipe) -> dict[str, Any] | None:
    d = recipe.directory()
    try:
        stamp: dict[str, Any] = json.loads((d / "stamp.json").read_text())
    except (OSError, ValueError):
        return None
    if stamp.get("key") != recipe.key() or not (d / stamp.get("wheel", "")).is_file():
        return None
    return stamp


def _check_wheel(wheel: Path) -> list[Findings]:
    with tempfile.TemporaryDirectory(prefix="llama-check-") as tmp:
        with zipfile.ZipFile(wheel) as z:
            z.extractall(tmp)
        return [check_library(lib) for lib in libraries(Path(tmp))]


def build(recipe: Recipe) -> dict[str, Any]:
    """The cold build (the caller holds the lock and found no valid stamp)."""
    d = recipe.directory()
    if d.exists():
        shutil.rmtree(d)  # a half-built directory from an interrupted run
    d.mkdir(parents=True)
    log = d / "build.log"
    say(f"building {PACKAGE} {recipe.version} ({recipe.flavour}) into {d}; log: {log}")
    say(f"  CMAKE_ARGS={' '.join(recipe.cmake_args)}")
    env = dict(os.environ, CMAKE_ARGS=" ".join(recipe.cmake_args), FORCE_CMAKE="1",
               CMAKE_BUILD_PARALLEL_LEVEL=os.environ.get("QOSGATE_LLAMA_JOBS")
               or str(os.cpu_count() or 2))
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", "wheel", "--no-deps",
           "--no-cache-dir", "--no-binary", PACKAGE, "-w", str(d),
           f"{PACKAGE}=={recipe.version}"]
    t = time.monotonic()
    with log.open("wb") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    took = time.monotonic() - t
    if rc != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(f"pip wheel exited {rc} after {took:.0f} s; last lines of {log}:\n"
                         + "\n".join(tail))
    wheels = sorted(d.glob("*.whl"))
    if len(wheels) != 1:
        raise SystemExit(f"expected one wheel in {d}, found {[w.name for w in wheels]}")
    say(f"  compiled in {took:.0f} s")
    checked = _check_wheel(wheels[0]) if platform.machine() in ("x86_64", "AMD64") else []
    bad = [f for f in checked if not f.portable]
    if bad and not recipe.native:
        raise SystemExit("the portable build is not portable:\n" + "\n".join(
            f.summary() for f in bad))
    for f in checked:
        say(f"  {Path(f.path).name}: {'portable' if f.portable else 'native instructions'}")
    stamp = {"key": recipe.key(), "wheel": wheels[0].name, "build_s": round(took, 1),
             "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
             "portable": not bad}
    (d / "stamp.json").write_text(json.dumps(stamp, indent=2) + "\n")
    return stamp


def ensure(recipe: Recipe) -> dict[str, Any]:
    stamp = read_stamp(recipe)
    if stamp is None:
        with locked(recipe.directory()):
            stamp = read_stamp(recipe) or build(recipe)
    else:
        say(f"cached: {recipe.directory()} ({recipe.flavour}; its build took "
            f"{stamp.get('build_s', '?')} s on {stamp.get('built_at', '?')})")
    return stamp


def _venv_marker(python: str) -> Path:
    prefix = subprocess.check_output([python, "-c", "import sys; print(sys.prefix)"], text=True)
    return Path(prefix.strip()) / "qosgate-llama-build.json"


def install(recipe: Recipe, python: str) -> None:
    """Put the recipe's wheel into ``python``'s environment unless its marker says it is there;
    a build of any other origin (pip's cache, a native wheel) is replaced."""
    stamp = ensure(recipe)
    marker = _venv_marker(python)
    want = {"key": recipe.key(), "wheel": stamp["wheel"]}
    with contextlib.suppress(OSError, ValueError):
        if json.loads(marker.read_text()) == want:
            say(f"{PACKAGE} {recipe.version} ({recipe.flavour}) is installed in {marker.parent}")
            return
    wheel = recipe.directory() / stamp["wheel"]
    pip = [python, "-m", "pip", "--disable-pip-version-check", "install", "--quiet"]
    t = time.monotonic()
    subprocess.check_call([*pip, "--force-reinstall", "--no-deps", str(wheel)])
    subprocess.check_call([*pip, str(wheel)])  # its own requirements (numpy, jinja2, ...)
    marker.write_text(json.dumps(want, indent=2) + "\n")
    say(f"installed {wheel.name} ({recipe.flavour}) into {marker.parent} in "
        f"{time.monotonic() - t:.0f} s")


def check(paths: Sequence[str], python: str | None) -> int:
    targets = [Path(p) for p in paths]
    if python:
        targets += libraries(installed_package_dir(python))
    if not targets:
        raise SystemExit("nothing to check: name libraries or --python")
    bad = 0
    for lib in targets:
        found = check_library(lib)
        print(found.summary())
        bad += not found.portable
    return 1 if bad else 0


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("build", "install", "info"):
        p = sub.add_parser(name)
        p.add_argument("--native", action="store_true",
                       help="GGML_NATIVE=ON: runs on this CPU model only "
                       "(or QOSGATE_LLAMA_NATIVE=1)")
        if name == "install":
            p.add_argument("--python", required=True, help="the environment's Python")
    c = sub.add_parser("check", help="exit 1 unless every library is portable")
    c.add_argument("libs", nargs="*")
    c.add_argument("--python", help="check the llama_cpp installed for this Python")
    args = ap.parse_args(argv)
    if args.cmd == "check":
        sys.exit(check(args.libs, args.python))
    recipe = Recipe(pinned_version(), native_requested(args.native))
    if args.cmd == "info":
        print(json.dumps({"flavour": recipe.flavour, "directory": str(recipe.directory()),
                          "cmake_args": list(recipe.cmake_args), "stamp": read_stamp(recipe)},
                         indent=2))
    elif args.cmd == "build":
        ensure(recipe)
    else:
        install(recipe, args.python)


if __name__ == "__main__":
    main()
