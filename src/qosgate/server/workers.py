"""``qosgate serve --workers N``: N gateway processes on one port (``SO_REUSEPORT``).

The parent starts N copies of its own command line with ``--workers 1`` and
``QOSGATE_REUSE_PORT=1`` (each binds the same port; the kernel spreads connections over them),
each with its own instance id (``<id>-w<i>``); it passes SIGINT/SIGTERM on and exits when all
have exited, with the first non-zero status. With ``--redis`` the workers share tenant state;
without it each keeps its own limits (a limit of R per minute is then R per worker).
"""

from __future__ import annotations

import os
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


def run_workers(n: int, instance_id: str | None) -> int:
    base = instance_id or f"{socket.gethostname()}-{os.getpid()}"
    args = [sys.executable, "-m", "qosgate.cli", *_argv_without_workers(sys.argv[1:])]
    if "QOSGATE_WORKERS" in os.environ:
        os.environ.pop("QOSGATE_WORKERS")
    procs: list[subprocess.Popen[bytes]] = []
    for i in range(n):
        env = dict(os.environ, QOSGATE_REUSE_PORT="1", QOSGATE_INSTANCE_ID=f"{base}-w{i}")
        procs.append(subprocess.Popen(args, env=env))

    def forward(sig: int, frame: FrameType | None) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    rc = 0
    for p in procs:
        code = p.wait()
        if code and not rc:
            rc = code
    return rc
