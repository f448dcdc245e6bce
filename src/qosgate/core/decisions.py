"""What the scheduler tells its driver to do. Plain records: the driver does the I/O."""

from __future__ import annotations

from dataclasses import dataclass

from qosgate.core.request import Request


@dataclass(slots=True)
class Dispatch:
    """Start (or, with ``resume``, continue a paused) ``req`` on ``replica``."""

    req: Request
    replica: str
    resume: bool = False


@dataclass(slots=True)
class Preempt:
    """Pull ``req`` back from ``replica``. With ``pause`` the engine keeps its state and the request
    resumes there later; without, the driver aborts the engine call (nothing reached the client)."""

    req: Request
    replica: str
    pause: bool = False


@dataclass(slots=True)
class Finished:
    """``req`` reached its terminal state (``req.state``/``req.reason``; ``req.retry_after`` is set
    for refusals). Emitted once per accepted or refused request."""

    req: Request


Decision = Dispatch | Preempt | Finished
