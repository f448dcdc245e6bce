"""The batch store through a ``kill -9`` of the process writing to it: the database stays whole,
every committed answer is kept, the rest can be answered. (The store on its own:
``tests/runtime/batches/test_store.py``.)"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from qosgate.runtime.batches.store import BatchStore
from tests.support.batch_store import job, line, ok, read_jsonl, run

_WRITER = """
import asyncio, sys
from pathlib import Path
from qosgate.runtime.batches.records import LineResult
from qosgate.runtime.batches.store import BatchStore

async def main() -> None:
    s = BatchStore(Path(sys.argv[1]), lambda: 1_700_000_000.0)
    await s.open()
    batch_id = sys.argv[2]
    while True:
        tasks = await s.next_lines(batch_id, 7, ())
        if not tasks:
            break
        await s.record(1, [LineResult(batch_id, t.line, "r", 200, b"{}") for t in tasks])
        print(tasks[-1].line, flush=True)
    print("done", flush=True)

asyncio.run(main())
"""



@pytest.mark.e2e
def test_a_killed_writer_leaves_a_whole_database(tmp_path: Path) -> None:
    """kill -9 of a process in the middle of recording: reopened, every committed answer is
    there, the counts agree with the lines, and the rest can be answered."""
    async def make(s: BatchStore) -> str:
        return (await job(s, [line(f"c{i}") for i in range(3000)])).id

    batch_id = run(make, tmp_path)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", _WRITER, str(tmp_path), batch_id],
                            stdout=subprocess.PIPE, env=env, text=True)
    assert proc.stdout is not None
    for _ in range(50):  # some transactions committed, the writer still going
        assert proc.stdout.readline().strip() not in ("", "done")
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    with sqlite3.connect(tmp_path / "batches.sqlite3") as db:
        assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)

    async def check(s: BatchStore) -> None:
        b = await s.batch(batch_id, None)
        assert b is not None
        left = await s.next_lines(batch_id, 5000, ())
        assert b.completed >= 50 * 7
        assert b.completed + len(left) == 3000  # every line answered once or still to run
        assert await s.record(1, [ok(batch_id, t.line) for t in left]) == len(left)
        done = await s.finish(batch_id, 1, "completed")
        assert (done.completed, done.failed, done.error_file_id) == (3000, 0, None)
        assert done.output_file_id is not None
        outs = read_jsonl(s.file_path(done.output_file_id))
        assert sorted(o["custom_id"] for o in outs) == sorted(f"c{i}" for i in range(3000))
    run(check, tmp_path)
