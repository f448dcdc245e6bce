"""Who holds a batch directory, as the directory tests name them: ``holder(n)``, the gateway
``gw-n`` (pid 1000 + n, on port 8000 + n), and ``ALONE``, a deployment that shares with no one."""

from __future__ import annotations

from qosgate.runtime.batches.directory import Holder, Sharing

ALONE = Sharing("alone")


def holder(n: int) -> Holder:
    return Holder(1000 + n, f"gw-{n}", f"127.0.0.1:{8000 + n}")
