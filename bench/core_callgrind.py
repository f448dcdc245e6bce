"""Benchmark: instructions per scheduling cycle, counted by callgrind, before and after in one run.

The cycle is ``core_ops.py``'s (submit + complete + pick/dispatch + first token at a constant queue
depth), run by that file's own ``prepare_cycles``. Instructions, unlike CPU time, do not depend on
what else the machine is doing, so a change of a few percent shows up reliably.

How setup and interpreter start-up are kept out: each measurement is two callgrind runs of a child
process that builds the same scheduler and the same inputs for ``N + M`` cycles, then runs ``N``
cycles in one and ``N + M`` in the other, and leaves with ``os._exit`` (no teardown). Everything but
the last ``M`` cycles is the same in both, so

    instructions per cycle = (Ir(N + M cycles) - Ir(N cycles)) / M

(the first ``N`` cycles also warm the caches, dicts and heaps to their steady size). Both runs use
``PYTHONHASHSEED=0``, so string hashes, and with them dict and set layouts, are the same.

``--before REV`` checks REV out into a temporary ``git worktree`` and measures its ``src`` beside
the current tree's, with the same Python, the same driver (this tree's ``core_ops.py``), the same
seeds and inputs; only ``PYTHONPATH`` differs. The worktree is removed at the end.

Default: 1,000 queued, N = 500, M = 2,000, policies fifo and qos (a few minutes in all).

    python bench/core_callgrind.py [--before main] [--policies fifo,qos] [--depth 1000]
                                   [--warm 500] [--cycles 2000]
"""

from __future__ import annotations

import argparse
import gc
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
_COLLECTED = re.compile(r"Collected\s*:\s*(\d+)")


def _child(policy: str, depth: int, prepared: int, run: int) -> None:
    """Under callgrind: build the scheduler and ``prepared`` cycles of inputs, run ``run``."""
    sys.path.insert(0, str(BENCH))
    from core_ops import prepare_cycles

    import qosgate  # (here, not at the top: from the tree on PYTHONPATH, under callgrind)

    print(qosgate.__file__)  # the parent checks the core measured is the one asked for
    cycles = prepare_cycles(policy, depth, prepared)
    gc.collect()
    gc.disable()  # as bench_cycles: a collection would land in one run's cycles and not the other's
    cycles(run)
    sys.stdout.flush()
    os._exit(0)


def _instructions(src: Path, policy: str, depth: int, prepared: int, run: int) -> int:
    """Ir of one child run under callgrind, with ``src`` first on the path."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            "valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out",
            sys.executable, str(Path(__file__).resolve()), "--child",
            policy, str(depth), str(prepared), str(run),
        ]
        env = dict(os.environ, PYTHONPATH=str(src), PYTHONHASHSEED="0")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    found = _COLLECTED.search(done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"callgrind run failed ({' '.join(cmd)}):\n{done.stderr[-2000:]}")
    if not Path(done.stdout.strip()).is_relative_to(src):
        raise SystemExit(f"measured {done.stdout.strip()}, not the core under {src}")
    return int(found.group(1))


def per_cycle(src: Path, policy: str, depth: int, warm: int, cycles: int) -> float:
    total = warm + cycles
    short = _instructions(src, policy, depth, total, warm)
    long = _instructions(src, policy, depth, total, total)
    return (long - short) / cycles


def _worktree(rev: str, where: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(where), rev],
                   check=True, capture_output=True)


def _remove_worktree(where: Path) -> None:
    subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(where)],
                   check=False, capture_output=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        policy, depth, prepared, run = sys.argv[2:6]
        _child(policy, int(depth), int(prepared), int(run))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--before", help="a git revision to measure beside the current tree")
    ap.add_argument("--policies", default="fifo,qos")
    ap.add_argument("--depth", type=int, default=1000, help="queued requests (constant)")
    ap.add_argument("--warm", type=int, default=500, help="N: cycles in both runs")
    ap.add_argument("--cycles", type=int, default=2000, help="M: cycles counted")
    args = ap.parse_args()
    policies = args.policies.split(",")

    print(f"instructions per cycle (callgrind Ir), {args.depth:,} queued, "
          f"(Ir of {args.warm + args.cycles:,} cycles - Ir of {args.warm:,}) / {args.cycles:,}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="qosgate-before-") as tmp:
        before_tree = Path(tmp) / "tree"
        if args.before:
            _worktree(args.before, before_tree)
        try:
            header = f"{'policy':>9} | {'before':>9} | {'after':>9} | ratio"
            print(f"before: {args.before or '-'}; after: {ROOT}")
            print(header)
            print("-" * len(header))
            for p in policies:
                after = per_cycle(ROOT / "src", p, args.depth, args.warm, args.cycles)
                if args.before:
                    before = per_cycle(before_tree / "src", p, args.depth, args.warm, args.cycles)
                    print(f"{p:>9} | {before:>9,.0f} | {after:>9,.0f} | {after / before:.3f}",
                          flush=True)
                else:
                    print(f"{p:>9} | {'-':>9} | {after:>9,.0f} |", flush=True)
        finally:
            if args.before:
                _remove_worktree(before_tree)


if __name__ == "__main__":
    main()
