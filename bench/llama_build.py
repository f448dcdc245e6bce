"""The embedded engine's speed under different llama.cpp builds, measured side by side.

    .venv/bin/python bench/llama_build.py NAME=WHEEL [NAME=WHEEL ...] [--rounds 3]
        [--threads 2] [--tokens 64]

Each wheel (e.g. the portable one ``scripts/llama_env.py build`` caches, and a native one made
with ``--native``) is unpacked into its own folder; then, round after round and build after
build (alternating, so that a busy spell of the shared machine falls on each build alike), a
fresh process imports that build and runs ``bench/llamacpp_engine.py``'s batching part: 1, 2, 4
and 8 greedy sequences of ``--tokens`` tokens on ``LlamaCppEngine``. Printed per build: the best
round's output tokens/s (prefill included) and mean decode step at each batch size, and the
ratio of each build to the first.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ("import json, sys; sys.path.insert(0, {bench!r}); import llama_cpp; "
       "from llamacpp_engine import batching; "
       "print(json.dumps({{'lib': llama_cpp.__file__, "
       "'info': llama_cpp.llama_print_system_info().decode(), "
       "'rows': batching({threads}, {tokens}, 1)}}))")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("builds", nargs="+", help="NAME=WHEEL")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 1))
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    builds = dict(b.split("=", 1) for b in args.builds)
    best: dict[str, dict[int, tuple[float, float]]] = {name: {} for name in builds}
    with tempfile.TemporaryDirectory(prefix="llama-builds-") as tmp:
        dirs = {}
        for name, wheel in builds.items():
            dirs[name] = Path(tmp) / name
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                            "--disable-pip-version-check", "--target", str(dirs[name]), wheel],
                           check=True)
        code = RUN.format(bench=str(ROOT / "bench"), threads=args.threads, tokens=args.tokens)
        for r in range(args.rounds):
            for name in builds:
                env = dict(os.environ, PYTHONPATH=str(dirs[name]))
                out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                                     capture_output=True, text=True).stdout
                doc = json.loads(out.strip().splitlines()[-1])
                assert doc["lib"].startswith(str(dirs[name])), doc["lib"]
                if r == 0:
                    print(f"{name}: {doc['info'].strip()}")
                for n, tps, step_ms in doc["rows"]:
                    if n not in best[name] or tps > best[name][n][0]:
                        best[name][n] = (tps, step_ms)
    first = next(iter(builds))
    print(f"\nbest of {args.rounds} rounds, {args.threads} threads, {args.tokens} tokens "
          f"per sequence (greedy); ratio against {first}")
    print(f"{'build':>10} | seqs | output tok/s | ratio | decode step ms | ratio")
    for name in builds:
        for n, (tps, step) in sorted(best[name].items()):
            b_tps, b_step = best[first][n]
            print(f"{name:>10} | {n:>4} | {tps:>12.1f} | {tps / b_tps:>4.2f}x | {step:>14.1f} | "
                  f"{step / b_step:>4.2f}x")


if __name__ == "__main__":
    main()
