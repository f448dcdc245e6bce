"""What ``GatewayMetrics.observe`` (called once per request at its terminal state) costs, before
the observability metrics and now: best of 15 runs of 100,000 calls each on a completed
request, the two versions' runs interleaved so that a busy machine slows both alike.

    .venv/bin/python bench/metrics_observe.py [--before REV]   # REV: git revision of before

``--before`` reads ``src/qosgate/server/metrics.py`` at that revision (default ``d0fbb95~1``, the
commit before the registry) with ``git show``.
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import timeit
from pathlib import Path
from types import ModuleType
from typing import Any

from qosgate.config import default_config
from qosgate.core import Request, Scheduler, State
from qosgate.server import metrics as now

ROOT = Path(__file__).resolve().parents[1]


def load_at(rev: str) -> ModuleType:
    text = subprocess.run(["git", "show", f"{rev}:src/qosgate/server/metrics.py"], cwd=ROOT,
                          check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "metrics_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("metrics_before", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def completed() -> Request:
    r = Request("r", "default", "api", 1, 100.0, 101.0, 50, 64)
    r.dispatched_at, r.first_token_at, r.finished_at = 100.01, 100.2, 101.0
    r.output_tokens, r.state, r.replica = 40, State.COMPLETED, "x"
    return r


def costs_us(mods: list[Any], runs: int = 15, number: int = 100_000) -> list[float]:
    """Best time per call of each module's ``observe``, runs interleaved."""
    calls = []
    for mod in mods:
        gm = mod.GatewayMetrics(Scheduler(default_config()), clock=lambda: 0.0)
        r = completed()
        calls.append(lambda gm=gm, r=r: gm.observe(r))
    best = [float("inf")] * len(mods)
    for _ in range(runs):
        for i, call in enumerate(calls):
            best[i] = min(best[i], timeit.timeit(call, number=number) / number * 1e6)
    return best


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="d0fbb95~1")
    args = p.parse_args(argv)
    before, after = costs_us([load_at(args.before), now])
    print(f"python {sys.version.split()[0]}")
    print(f"observe() before ({args.before}): {before:.2f} us per request")
    print(f"observe() now: {after:.2f} us per request (+{after - before:.2f} us)")


if __name__ == "__main__":
    main()
