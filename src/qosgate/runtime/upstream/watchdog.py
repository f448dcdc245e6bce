"""The time bounds of one engine call, kept by one timer (``Watchdog``)."""

from __future__ import annotations

import asyncio
from typing import Any


class Watchdog:
    """One timer per engine call for its time bounds: the first byte to the client, silence
    between streamed chunks, and the whole call. It re-arms itself lazily (a chunk only stamps
    ``last``; the first byte only sets ``delivered``), and on expiry cancels the call's task with
    ``fired`` naming the bound. Until the first byte it also wakes every ``idle_s``, so that
    once the first byte is out the idle bound holds from then on, however far off the
    first-byte bound was (an offline class's is ~50 minutes by default)."""

    __slots__ = ("delivered", "fired", "first_at", "handle", "idle_s", "last", "loop", "task",
                 "total_at")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, task: asyncio.Task[Any], first_byte_s: float,
        idle_s: float, total_s: float,
    ) -> None:
        now = loop.time()
        self.loop = loop
        self.task = task
        self.first_at = now + first_byte_s
        self.total_at = now + total_s
        self.idle_s = idle_s
        self.last = now
        # the first byte is out: to the client (a stream), or, for a client that gets its
        # answer whole, from the engine; the idle bound holds from then on
        self.delivered = False
        self.fired: str | None = None
        self.handle = loop.call_at(min(self.first_at, self.total_at, now + idle_s), self._check)

    def _check(self) -> None:
        now = self.loop.time()
        if now >= self.total_at:
            self.fire("total_timeout")
        elif not self.delivered:
            if now >= self.first_at:
                self.fire("first_byte_timeout")
            else:
                self.handle = self.loop.call_at(
                    min(self.first_at, self.total_at, now + self.idle_s), self._check)
        elif now - self.last >= self.idle_s:
            self.fire("idle_timeout")
        else:
            self.handle = self.loop.call_at(min(self.total_at, self.last + self.idle_s),
                                            self._check)

    def fire(self, reason: str) -> None:
        """End the call now for ``reason`` (its bound ran out, or its engine stalled)."""
        self.fired = reason
        if not self.task.done():
            self.task.cancel()

    def stop(self) -> None:
        self.handle.cancel()

