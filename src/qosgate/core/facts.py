"""What a driver tells the core about an engine call, as typed values: one name per fact, the same
value from the engine's reader through the driver to the scheduler and the fleet (no keyword
list spelled again at every hop).

A completion is not one of them: it is told as plain counts (``Scheduler.complete``), because
every request ends so and building a value there would cost the hot path for nothing.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AttemptFailed:
    """An engine call failed before anything reached the client, so the core may try another
    replica. ``reason``: the request's reason if it is not retried; ``retryable``: False where a
    retry would fail the same way (a timeout the request's own budget set); ``unreachable``: the
    replica refused the connection (it is down until a probe says otherwise);
    ``backpressure``: the engine answered 429/503, so the replica is cooled for
    ``retry_after`` seconds (None: the configured cooldown) and its window told, not counted as
    a fault."""

    reason: str
    retryable: bool = True
    unreachable: bool = False
    backpressure: bool = False
    retry_after: float | None = None
