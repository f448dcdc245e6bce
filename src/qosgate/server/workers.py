"""``qosgate serve --workers N``: N gateway processes on one port (``SO_REUSEPORT``).

The parent starts N copies of its own command line with ``--workers 1`` and
``QOSGATE_REUSE_PORT=1`` (each binds the same port; the kernel spreads connections over them),
each with its own instance id (``<id>-w<i>``); it passes SIGINT/SIGTERM/SIGHUP on (each worker
drains, or ignores the hang-up, itself) and exits when all
have exited, with the first non-zero status. With ``--redis`` the workers share tenant state;
without it each keeps its own limits (a limit of R per minute is then R per worker).

The workers are one deployment: they share the port, so the batch directory, and each is told
its group and index (``QOSGATE_WORKER``). Without Redis, nothing would keep two of them from
running one job's lines at once, so worker 0 alone runs jobs; the others serve the Batch API
(``runtime/batches/directory.py``). A group is new at each start: workers of an earlier start
still alive are another deployment.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
from types import FrameType


def _argv_without_workers(argv: list[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--workers", "--instance-id"):
            skip = True
            continue
        if a.startswith(("--workers=", "--instance-id=")):
            continue
        out.append(a)
    return out


WORKER_ENV = "QOSGATE_WORKER"  # "<group> <index>": set by the parent for each worker


def this_worker() -> tuple[str, int] | None:
    """(group, index) if this process is a worker of ``serve --workers``."""
    group, _, index = os.environ.get(WORKER_ENV, "").rpartition(" ")
    return (group, int(index)) if group and index.isdigit() else None


def run_workers(n: int, instance_id: str | None) -> int:
    base = instance_id or f"{socket.gethostname()}-{os.getpid()}"
    group = f"pid {os.getpid()}.{secrets.token_hex(4)}"
    args = [sys.executable, "-m", "qosgate.cli", *_argv_without_workers(sys.argv[1:])]
    if "QOSGATE_WORKERS" in os.environ:
        os.environ.pop("QOSGATE_WORKERS")
    procs: list[subprocess.Popen[bytes]] = []
    for i in range(n):
        env = dict(os.environ, QOSGATE_REUSE_PORT="1", QOSGATE_INSTANCE_ID=f"{base}-w{i}",
                   **{WORKER_ENV: f"{group} {i}"})
        procs.append(subprocess.Popen(args, env=env))

    def forward(sig: int, frame: FrameType | None) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGHUP, forward)
    rc = 0
    for p in procs:
        code = p.wait()
        if code and not rc:
            rc = code
    return rc
