#!/usr/bin/env python3
"""Re-run every simulator command the docs show with its output, and diff the output.

The docs print simulator tables as evidence; this keeps them honest. A *doc table* is a fenced
block in README.md or docs/**/*.md whose first line is a command prompt for the simulator::

    <!-- doc-table: excerpt cheap -->
    ```console
    $ qosgate simulate --scenario seed-classes --policies qos --load 0.5
    ...the output, as printed...
    ```

(``qosgate replay --help`` and ``qosgate calibrate --help`` are checked too: those commands
need a live endpoint, so only their help is ever run.)

Every such block is checked; the optional HTML comment on the line just before the fence says how:

- ``full`` (the default): the block is the command's whole standard output;
- ``excerpt``: the block shows part of it: each run of lines between ``...`` lines must appear,
  contiguous and in order, in the output (the docs leave out the scenario's description, the
  data attribution and the file list);
- ``cheap``: the command runs in a few seconds; ``--cheap`` (and ``tests/test_doc_tables.py``)
  runs only these;
- ``skip: REASON``: listed, never run (a command that cannot be re-run here).

Lines are compared byte for byte after trailing whitespace is removed (rich pads a table's title
line to the table's width; the docs do not keep trailing blanks). One line is volatile and left
out of both the output and the doc block: the wall-clock line (``3 run(s), 14601 simulated
requests in 23.1 s wall (632 requests/s)``). Commands run as ``sys.executable`` calling
``qosgate.cli.app``, with this checkout's ``src/`` first on the path, in a scratch working
directory (so ``--out results/`` writes there).

    python scripts/doc_tables.py            # run every doc table, diff, exit 1 on a difference
    python scripts/doc_tables.py --list     # what would run, where, how
    python scripts/doc_tables.py --cheap    # the few-seconds subset (CI)
    python scripts/doc_tables.py --only fleet-mixed --update   # rewrite those blocks' output

A refactor that must not change behaviour is checked against the code before it, whatever the
docs say: run the old tree's code and keep its outputs, then compare the new code's with them::

    git worktree add /tmp/before REV
    python scripts/doc_tables.py --src /tmp/before/src --save /tmp/out-before
    python scripts/doc_tables.py --baseline /tmp/out-before   # identical to the old code's output
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "$ qosgate "
COMMANDS = ("simulate", "simulate-embeddings")  # the simulator's commands; nothing else is run
HELP_ONLY = ("replay", "calibrate")  # commands that need a live endpoint: their --help alone
MARKER = re.compile(r"^<!--\s*doc-table:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(`{3,})(\w*)\s*$")
GAP = "..."
# the CLI as the console script runs it, so that its help says "qosgate", not "python -m ..."
RUN_AS_QOSGATE = "import sys; from qosgate.cli import app; app(prog_name='qosgate')"
# the one line of a run that depends on the machine, not on the simulation
VOLATILE = re.compile(
    r"^\d+ run\(s\), \d+ simulated requests in [\d.]+ s wall \([\d.]+ requests/s\)$")


@dataclass
class Table:
    """One documented command and the output block shown for it."""

    path: Path
    line: int  # 1-based line of the command in the file
    argv: list[str]  # after "qosgate"
    shown: list[str]  # the block's lines after the command
    mode: str  # "full" or "excerpt"
    cheap: bool
    skip: str | None
    body_start: int  # 0-based index of the first output line in the file
    body_end: int  # 0-based index of the closing fence

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def command(self) -> str:
        return "qosgate " + shlex.join(self.argv)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse_marker(text: str) -> tuple[str, bool, str | None]:
    mode, cheap, skip = "full", False, None
    if text.startswith("skip:"):
        return mode, cheap, text[5:].strip() or "no reason given"
    for word in text.split():
        if word in ("full", "excerpt"):
            mode = word
        elif word == "cheap":
            cheap = True
        else:
            raise SystemExit(f"unknown doc-table option {word!r} in <!-- doc-table: {text} -->")
    return mode, cheap, skip


def find_tables(path: Path) -> list[Table]:
    lines = path.read_text().split("\n")
    tables: list[Table] = []
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == fence.group(1)),
                   None)
        if end is None:
            raise SystemExit(f"{path.relative_to(ROOT)}:{i + 1}: a fence that is never closed")
        first = lines[i + 1] if i + 1 < end else ""
        words = first[len(PROMPT):].split() if first.startswith(PROMPT) else []
        if words and (words[0] in COMMANDS or (words[0] in HELP_ONLY and words[1:] == ["--help"])):
            cmd, k = first[len(PROMPT):], i + 1
            while cmd.endswith("\\"):  # a command continued over several lines
                k += 1
                cmd = cmd[:-1] + " " + lines[k].strip()
            marker = MARKER.match(lines[i - 1]) if i > 0 else None
            mode, cheap, skip = parse_marker(marker.group(1)) if marker else ("full", False, None)
            tables.append(Table(path, i + 2, shlex.split(cmd), lines[k + 1:end], mode, cheap,
                                skip, k + 1, end))
        i = end + 1
    return tables


def run(table: Table, src: Path = ROOT / "src") -> tuple[list[str], float, int]:
    """The command's standard output lines (trailing blanks and the volatile line removed), run
    with the code under ``src``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(src), *filter(None, [os.environ.get("PYTHONPATH")])]))
    env.pop("COLUMNS", None)  # the simulator picks its width for a pipe itself (150)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="doc-table-") as tmp:
        proc = subprocess.run([sys.executable, "-c", RUN_AS_QOSGATE, *table.argv], cwd=tmp,
                              env=env, capture_output=True, text=True, check=False)
    out = [ln.rstrip() for ln in proc.stdout.split("\n")]
    while out and not out[-1]:
        out.pop()
    out = [ln for ln in out if not VOLATILE.match(ln)]
    if proc.returncode != 0:
        out += [f"[exit {proc.returncode}] " + ln for ln in proc.stderr.strip().split("\n")[-5:]]
    return out, time.monotonic() - t0, proc.returncode


def saved_name(argv: list[str]) -> str:
    """The file a command's output is saved under: the same command, the same name."""
    return hashlib.sha1(shlex.join(argv).encode()).hexdigest()[:16] + ".txt"


def chunks(shown: list[str]) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    for ln in shown:
        if VOLATILE.match(ln.rstrip()):  # a doc may show its run's wall-clock line: not compared
            continue
        if ln.strip() in (GAP, "…"):
            parts.append([])
        else:
            parts[-1].append(ln.rstrip())
    return [p for p in parts if p]


def compare(table: Table, out: list[str]) -> list[str]:
    """The differences as diff lines; empty when the doc matches."""
    shown = [ln.rstrip() for ln in table.shown if not VOLATILE.match(ln.rstrip())]
    if table.mode == "full":
        if shown == out:
            return []
        return list(difflib.unified_diff(shown, out, "doc", "run", lineterm="", n=1))
    pos = 0
    for part in chunks(shown):
        at = next((k for k in range(pos, len(out) - len(part) + 1)
                   if out[k:k + len(part)] == part), None)
        if at is None:
            # show the part against the output region it resembles most
            best = max(range(max(1, len(out) - len(part) + 1)),
                       key=lambda k: difflib.SequenceMatcher(
                           None, part, out[k:k + len(part)]).ratio())
            return list(difflib.unified_diff(part, out[best:best + len(part)], "doc", "run",
                                             lineterm="", n=1))
        pos = at + len(part)
    return []


def update(table: Table, out: list[str]) -> None:
    """Write the fresh output into the block (an excerpt keeps its shape: each part is replaced
    by the output lines that match it best, so re-check the prose around it)."""
    lines = table.path.read_text().split("\n")
    if table.mode == "full":
        fresh = out
    else:
        fresh, pos = [], 0
        for n, part in enumerate(chunks(table.shown)):
            at = max(range(pos, max(pos + 1, len(out) - len(part) + 1)),
                     key=lambda k: difflib.SequenceMatcher(
                         None, part, out[k:k + len(part)]).ratio())
            fresh += ([GAP] if n else []) + out[at:at + len(part)]
            pos = at + len(part)
    lines[table.body_start:table.body_end] = fresh
    table.path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--list", action="store_true", help="list the doc tables and exit")
    ap.add_argument("--only", metavar="PATTERN",
                    help="only tables whose command or file:line contains PATTERN (a regex)")
    ap.add_argument("--cheap", action="store_true", help="only the tables marked cheap")
    ap.add_argument("--update", action="store_true",
                    help="rewrite each differing block with the fresh output")
    ap.add_argument("--src", type=Path, default=ROOT / "src",
                    help="run the code of this source tree (default: this checkout's src/)")
    ap.add_argument("--save", type=Path, metavar="DIR",
                    help="also write each command's output to DIR (one file per command)")
    ap.add_argument("--baseline", type=Path, metavar="DIR",
                    help="compare each output with the one saved in DIR (--save of another "
                    "tree), byte for byte, instead of with the doc")
    args = ap.parse_args(argv)
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)

    tables = [t for f in doc_files() for t in find_tables(f)]
    if args.only:
        pat = re.compile(args.only)
        tables = [t for t in tables if pat.search(t.command) or pat.search(t.where)]
    if args.cheap:
        tables = [t for t in tables if t.cheap]
    if args.list:
        for t in tables:
            how = f"skip ({t.skip})" if t.skip else t.mode + (" cheap" if t.cheap else "")
            print(f"{t.where:32} {how:14} {t.command}")
        print(f"{len(tables)} doc table(s)")
        return 0

    # --update edits files: go from the end so earlier blocks' line numbers stay right
    failed = same = skipped = 0
    t_all = time.monotonic()
    for t in sorted(tables, key=lambda t: (str(t.path), -t.line)) if args.update else tables:
        if t.skip:
            skipped += 1
            print(f"SKIP  {t.where}  {t.command}  ({t.skip})", flush=True)
            continue
        out, took, code = run(t, args.src.resolve())
        if args.save:
            (args.save / saved_name(t.argv)).write_text("\n".join(out) + "\n")
        if code != 0:
            diff = [f"exit {code}", *out[-5:]]
        elif args.baseline:
            before = (args.baseline / saved_name(t.argv)).read_text().split("\n")[:-1]
            diff = list(difflib.unified_diff(before, out, "baseline", "run", lineterm="", n=1))
        else:
            diff = compare(t, out)
        if not diff:
            same += 1
            print(f"ok    {t.where}  {t.command}  ({took:.1f} s)", flush=True)
            continue
        failed += 1
        print(f"DIFF  {t.where}  {t.command}  ({took:.1f} s, {t.mode})", flush=True)
        print("\n".join("      " + ln for ln in diff), flush=True)
        if args.update and code == 0 and not args.baseline:
            update(t, out)
            print(f"      updated {t.where}", flush=True)
    print(f"{len(tables)} doc table(s): {same} identical, {failed} different, {skipped} skipped; "
          f"{time.monotonic() - t_all:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
