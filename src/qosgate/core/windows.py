"""A replica's window (requests in flight at most): the ``WindowRule`` seam and its algorithms.

``FixedWindow`` only changes when told to; ``AdaptiveWindow`` adapts. Each declares whether it
learns from samples (``adaptive``), so the scheduler need not ask for its type. ``WINDOW_RULES``
builds each by its config name (``fleet.window.mode``).

Adaptive windows: dispatch only as much as keeps an engine busy, so the queue -- and every
decision -- stays in qosgate.

An engine queues what it cannot run instead of refusing it, so a loss-only (429) controller never
sees pressure: the window that matters is the one past which requests wait *inside* the engine,
out of qosgate's reach. ``AdaptiveWindow`` runs two loops on the facts the core is handed:

- the **capacity loop**, on the engine's own signals (``on_signals``): memory pressure (KV use
  above its target, or new engine-side preemptions) shrinks the window multiplicatively (once
  per ``cooldown_s``); a queue inside the engine beyond a small allowance, seen in two fresh
  samples in a row, with memory fine, means its batch is full: the window comes down to what
  the engine runs plus that allowance. (One sample is not enough: requests that arrived after
  the engine's last step are counted as waiting until its next one, and treating that as a
  full batch pinned the window near what it had sent.)
  It grows only when the window was full and the signals have been settled for ``settle_s`` --
  doubling until the first pressure (slow start), then by ``grow_frac``;
- the **latency loop**, on each request's dispatch-to-first-token time (``on_sample``): an
  engine that takes longer than ``latency_target_s`` to start a request is queueing it, whatever
  its metrics say, and the window shrinks as under pressure. A refusal with back-pressure
  (``dropped``) shrinks it too.

Stale signals (older than ``stale_s``) never grow the window. Time is passed in; nothing here
reads a clock. (Shape: Netflix concurrency-limits' ``Limit.onSample``; facts and defaults:
``shared/research/fleet.md``.)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

from qosgate.config import Window
from qosgate.core.signals import LoadSignals


class WindowRule(Protocol):
    """A replica's window. ``window`` is read on every dispatch; ``on_sample`` is told how one
    request went (``latency`` seconds to its first token, the in-flight count when it was sent,
    ``dropped`` if the engine refused it with back-pressure). ``adaptive``: whether samples can
    move it (the scheduler tells a fixed window none, and sets a fixed one only)."""

    @property
    def window(self) -> int: ...

    @property
    def adaptive(self) -> bool: ...

    def on_sample(self, now: float, latency: float, inflight: int, dropped: bool) -> None: ...

    def on_signals(self, now: float, signals: LoadSignals, inflight: int) -> None:
        """What the engine said of its own load (a scrape, or an in-process engine's state)."""
        ...


class FixedWindow:
    """A window that only changes when told to (``set``)."""

    __slots__ = ("window",)
    adaptive = False

    def __init__(self, window: int) -> None:
        self.window = max(0, window)

    def set(self, window: int) -> None:
        self.window = max(0, window)

    def on_sample(self, now: float, latency: float, inflight: int, dropped: bool) -> None:
        return None

    def on_signals(self, now: float, signals: LoadSignals, inflight: int) -> None:
        return None


class AdaptiveWindow:
    __slots__ = (
        "_last_change",
        "_last_preemptions",
        "_queue_seen_at",
        "_settled_since",
        "_slow_start",
        "cooldown_s",
        "grow_frac",
        "kv_target",
        "latency_target_s",
        "max_window",
        "min_window",
        "settle_s",
        "shrink",
        "stale_s",
        "waiting_allowance",
        "window",
    )
    adaptive = True

    def __init__(
        self,
        initial: int = 8,
        *,
        min_window: int = 1,
        max_window: int = 1024,
        kv_target: float = 0.9,
        waiting_allowance: float = 0.05,
        shrink: float = 0.8,
        grow_frac: float = 0.1,
        settle_s: float = 2.0,
        cooldown_s: float = 2.0,
        latency_target_s: float | None = None,
        stale_s: float = 5.0,
    ) -> None:
        self.min_window = max(1, min_window)
        self.max_window = max(self.min_window, max_window)
        self.window = min(self.max_window, max(self.min_window, initial))
        self.kv_target = kv_target
        self.waiting_allowance = waiting_allowance  # engine queue per window slot tolerated
        self.shrink = shrink
        self.grow_frac = grow_frac
        self.settle_s = settle_s
        self.cooldown_s = cooldown_s
        self.latency_target_s = latency_target_s
        self.stale_s = stale_s
        self._slow_start = True
        self._settled_since = -math.inf
        self._last_change = -math.inf
        self._last_preemptions: int | None = None
        self._queue_seen_at: float | None = None  # the sample that last showed a queue

    # ---------------------------------------------------------------- the two loops
    def on_signals(self, now: float, signals: LoadSignals, inflight: int) -> None:
        if now - signals.at > self.stale_s:
            return  # old news: neither grow nor shrink on it
        pressure = False
        pre = signals.preemptions_total
        if pre is not None:
            if self._last_preemptions is not None and pre > self._last_preemptions:
                pressure = True
            self._last_preemptions = pre
        if signals.kv_usage is not None and signals.kv_usage > self.kv_target:
            pressure = True
        if pressure:
            self._back_off(now)
            return
        allowance = max(1.0, self.waiting_allowance * self.window)
        running, waiting = signals.running, signals.waiting
        if waiting is not None and waiting > allowance:
            seen, self._queue_seen_at = self._queue_seen_at, signals.at
            if seen is None or seen == signals.at:
                return  # once may be arrivals between two engine steps: wait for the next sample
            # the engine runs what it can and queues the rest (its batch is full, its memory is
            # not): the window is what it runs plus a small queue, not a fraction of the old one
            # (shrinking by a factor overshot and then regrew, in cycles)
            self._slow_start = False
            self._settled_since = -math.inf
            if running is None:
                self._back_off(now)
                return
            # several gateways may feed one engine: each sizes its window as its share of what
            # the engine holds (alone, all of it), or every gateway would keep a window as large
            # as the engine's whole batch and together they would overfill it. (Any queue in
            # the engine beyond the allowance counts, whoever sent it: the conservative side,
            # which keeps realtime's TTFT; counting only its share let four gateways queue
            # four allowances in the engine, see docs/experiments/adaptive-windows.md.)
            target = max(self.min_window, int(signals.share(inflight) * (running + allowance)))
            if target < self.window and now - self._last_change >= self.cooldown_s:
                self.window = target
                self._last_change = now
            return
        self._queue_seen_at = None
        if self._settled_since == -math.inf:
            self._settled_since = now
        full = inflight >= self.window - 1
        if full and now - self._settled_since >= self.settle_s:
            step = self.window if self._slow_start else max(1, int(self.window * self.grow_frac))
            self.window = min(self.max_window, self.window + step)
            self._settled_since = now  # see what the new window does before growing again
            self._last_change = now

    def on_sample(self, now: float, latency: float, inflight: int, dropped: bool) -> None:
        target = self.latency_target_s
        if dropped or (target is not None and latency > target):
            self._back_off(now)

    def _back_off(self, now: float) -> None:
        self._slow_start = False
        self._settled_since = -math.inf
        if now - self._last_change < self.cooldown_s:
            return  # the last change has not shown its effect yet
        self.window = max(self.min_window, int(self.window * self.shrink))
        self._last_change = now


def _adaptive_window(max_window: int, w: Window) -> WindowRule:
    return AdaptiveWindow(
        min(max_window, w.initial), min_window=min(w.min, max_window), max_window=max_window,
        kv_target=w.kv_target, waiting_allowance=w.waiting_allowance, shrink=w.shrink,
        grow_frac=w.grow_frac, settle_s=w.settle_s, cooldown_s=w.cooldown_s,
        latency_target_s=w.latency_target_s, stale_s=w.stale_s,
    )


# each window algorithm by its config name (``fleet.window.mode``), built from the replica's
# ``max_window`` (the ceiling of an adaptive window, the size of a fixed one) and the window config
WINDOW_RULES: dict[str, Callable[[int, Window], WindowRule]] = {
    "adaptive": _adaptive_window,
    "fixed": lambda max_window, _: FixedWindow(max_window),
}


def build_window(mode: str, max_window: int, config: Window) -> WindowRule:
    """The window rule called ``mode`` for a replica whose window is at most ``max_window``."""
    try:
        make = WINDOW_RULES[mode]
    except KeyError:
        known = ", ".join(WINDOW_RULES)
        raise ValueError(f"unknown window mode {mode!r} (known: {known})") from None
    return make(max_window, config)
