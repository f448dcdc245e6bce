"""Whose batch directory this is, across processes: a lock that dies with its process
(``kill -9``), newcomers racing. (The lock within one process, the default directory, the
refusals and the file systems: ``tests/runtime/batches/test_directory.py``.)"""

from __future__ import annotations

import multiprocessing
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from qosgate.runtime.batches.directory import (
    DirectoryRefused,
    Sharing,
    lock_directory,
)
from tests.support.directory_holders import ALONE, holder

_HOLD = """
import sys
from pathlib import Path
from qosgate.runtime.batches.directory import Holder, Sharing, lock_directory
lock_directory(Path(sys.argv[1]), Sharing("alone"), Holder(0, "doomed", "127.0.0.1:1"))
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.e2e
def test_the_lock_dies_with_its_process(tmp_path: Path) -> None:
    """``kill -9``: no exit handler runs, and the directory is free for the restart."""
    p = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline() == "held\n"
        with pytest.raises(DirectoryRefused, match="doomed"):
            lock_directory(tmp_path, ALONE, holder(1))
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    lock_directory(tmp_path, ALONE, holder(1)).release()


def _race(directory: str, key: str, n: int, start: Any, results: Any, done: Any) -> None:
    start.wait(60)  # every process imported and ready: they try at once
    try:
        lock = lock_directory(Path(directory), Sharing("redis", key), holder(n))
    except DirectoryRefused:
        results.put((n, key, False))
        return
    results.put((n, key, True))
    done.wait(60)  # held until every newcomer has tried
    lock.release()


@pytest.mark.e2e
def test_newcomers_starting_together_share_only_the_way_the_first_does(tmp_path: Path) -> None:
    """Six processes, two sharings, at once: every process of the sharing that took the
    directory first joins it, every other is refused (an exclusive lock turned shared is let go
    for a moment: the gate keeps newcomers out of that moment)."""
    ctx = multiprocessing.get_context("spawn")
    for round_ in range(3):
        directory = tmp_path / f"round-{round_}"
        start, results, done = ctx.Barrier(6), ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_race,
                             args=(str(directory), "AB"[i % 2], i, start, results, done))
                 for i in range(6)]
        for p in procs:
            p.start()
        got = [results.get(timeout=120) for _ in procs]
        done.set()
        for p in procs:
            p.join(timeout=60)
        joined = {key for _, key, ok in got if ok}
        assert len(joined) == 1, got
        assert all(ok == (key in joined) for _, key, ok in got), got
