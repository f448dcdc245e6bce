"""Dynamic batching for embeddings: a pure, per-replica policy (the batching seam).

Requests the scheduler has dispatched to a replica are *collected* here before they run, and
released as one engine call (one upstream ``/v1/embeddings`` with a list, one llama.cpp decode):

- on **size** (``max_batch`` requests) or on a **token budget** (``max_tokens``, TEI's way);
- at once for a request that must not wait (realtime: ``urgent``), taking along what is pending;
- at once when nothing more can come (the replica has no room left for another dispatch);
- when the oldest pending request has waited the **linger** (as Kafka's ``linger.ms``).

Words: a *batch* here is what the engine runs as one call, as everywhere in qosgate (the engine's
batch); the *linger* is how long a request may wait for others to join it (the configuration
still calls it the embeddings ``window``); the *window* is only the replica's in-flight cap, and
the Batch API is *batches* (``runtime.batches``).

The linger is a ``LingerController``'s: ``FixedLinger`` (0: no linger at all; every request runs
when it arrives, as without a batcher) or ``AdaptiveLinger``, which follows the design brief's
feedback rule between a floor and a ceiling: every ``every`` batches it compares the measured
per-batch latency (smoothed, exponentially) against a target; over 1.2x the target the linger
shrinks by the ratio, under 0.8x it grows (by at most 2x, and only while batches do fill up
beyond one request: a linger that collects nobody only adds latency); the step is smoothed too
(``alpha``), so it does not oscillate. One exception to the brief's rule, after measuring it:
when the latency is the engine's queue (batches are released while two or more others are still
in flight there, smoothed), shrinking would make more and smaller calls and a longer queue, so
the linger grows instead.

``max_inflight`` (optional) bounds the batches running at the replica at once: while that many
run, the next one fills up (TEI's continuous batching: a busy engine makes big batches by
itself), and only a realtime request goes at once.

Invariant (the property tests): a request stays pending only while its linger runs (never longer
than the linger, which never exceeds the ceiling) or while the replica already runs
``max_inflight`` batches -- work-conserving unless a linger runs, bounded by its ceiling. Every
request that enters is released exactly once or removed (pulled back, cancelled) exactly once.

No clock reads: ``now`` is passed in by the driver (real time) or the simulator (virtual time).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

# how a linger evaluation moved the linger (not a scheduler ``Decision``)
LingerMove = Literal["grow", "shrink", "hold"]


@dataclass(frozen=True, slots=True)
class LingerDecision:
    """What the controller decided at an evaluation (a metric)."""

    at: float
    decision: LingerMove
    latency_s: float  # the smoothed per-batch latency it judged
    linger_s: float  # the linger from now on
    mean_batch: float  # the mean batch size over the evaluated batches


class LingerController(Protocol):
    @property
    def linger_s(self) -> float: ...

    def on_batch(self, now: float, size: int, latency_s: float,
                 ahead: int = 0) -> LingerDecision | None:
        """A batch of ``size`` finished, its oldest request ``latency_s`` after it arrived;
        ``ahead`` batches were still in flight at the engine when it was released."""
        ...


class FixedLinger:
    """A linger that never moves (0: none)."""

    def __init__(self, linger_s: float) -> None:
        if linger_s < 0:
            raise ValueError("linger_s must be >= 0")
        self._w = linger_s

    @property
    def linger_s(self) -> float:
        return self._w

    def on_batch(self, now: float, size: int, latency_s: float,
                 ahead: int = 0) -> LingerDecision | None:
        return None


class AdaptiveLinger:
    """The design brief's rule: 10-100 ms, re-evaluated every 10 batches against a latency target,
    exponentially smoothed (both the latency it measures and the step it takes)."""

    def __init__(
        self,
        floor_s: float = 0.010,
        ceiling_s: float = 0.100,
        target_s: float = 0.150,
        *,
        initial_s: float | None = None,
        every: int = 10,
        alpha: float = 0.5,
    ) -> None:
        if not 0 <= floor_s <= ceiling_s:
            raise ValueError("need 0 <= floor_s <= ceiling_s")
        if target_s <= 0 or every < 1 or not 0 < alpha <= 1:
            raise ValueError("need target_s > 0, every >= 1, 0 < alpha <= 1")
        self.floor_s = floor_s
        self.ceiling_s = ceiling_s
        self.target_s = target_s
        self.every = every
        self.alpha = alpha
        w = (floor_s + ceiling_s) / 2 if initial_s is None else initial_s
        self._w = min(ceiling_s, max(floor_s, w))
        self._lat: float | None = None  # smoothed per-batch latency
        self._ahead = 0.0  # smoothed count of batches still in flight at a release
        self._n = 0
        self._sizes = 0
        self.decisions: dict[LingerMove, int] = {"grow": 0, "shrink": 0, "hold": 0}

    @property
    def linger_s(self) -> float:
        return self._w

    def on_batch(self, now: float, size: int, latency_s: float,
                 ahead: int = 0) -> LingerDecision | None:
        lat = self._lat
        self._lat = latency_s if lat is None else lat + self.alpha * (latency_s - lat)
        self._ahead += self.alpha * (ahead - self._ahead)
        self._n += 1
        self._sizes += size
        if self._n < self.every:
            return None
        mean = self._sizes / self._n
        self._n = self._sizes = 0
        smoothed = self._lat
        ratio = smoothed / self.target_s
        w = self._w
        decision: LingerMove = "hold"
        # the engine is backed up (batches are released while two or more are still in flight
        # there, as when batches in flight are not limited): a smaller linger would only make
        # more, smaller calls and a longer queue -- the latency is the engine's, so open up
        congested = self._ahead >= 2.0
        if ratio > 1.2 and congested:
            proposed = w * 2.0
            decision = "grow"
        elif ratio > 1.2:
            proposed = w / ratio
            decision = "shrink"
        elif ratio < 0.8 and mean > 1.0:
            proposed = w * min(2.0, 1.0 / max(ratio, 1e-9))
            decision = "grow"
        elif ratio < 0.8:  # nobody to collect: the linger only adds latency
            proposed = self.floor_s
            decision = "shrink" if w > self.floor_s else "hold"
        else:
            proposed = w
        new = min(self.ceiling_s, max(self.floor_s, w + self.alpha * (proposed - w)))
        if (decision == "grow" and new <= w) or (decision == "shrink" and new >= w):
            decision = "hold"
        self._w = new
        self.decisions[decision] += 1
        return LingerDecision(now, decision, smoothed, new, mean)


@dataclass(slots=True)
class Pending:
    rid: str
    tokens: int
    urgent: bool
    arrived: float


@dataclass(frozen=True, slots=True)
class Batch:
    rids: tuple[str, ...]
    tokens: int
    opened: float  # when its oldest request arrived
    released: float
    why: Literal["size", "tokens", "urgent", "full", "window"]
    ahead: int = 0  # batches in flight at the engine when this one was released


@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_batch: int = 32
    max_tokens: int = 16384
    # batches in flight at the replica at once (0: no limit). While that many run, the next
    # batch fills up (TEI's way: a busy engine makes batches by itself); realtime still goes.
    max_inflight: int = 0

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_tokens < 1 or self.max_inflight < 0:
            raise ValueError("max_batch and max_tokens must be >= 1, max_inflight >= 0")


@dataclass(slots=True)
class Batcher:
    """One replica's collector. Requests keep the order they were added in (the scheduler's
    dispatch order: class, fairness); a batch takes the oldest first."""

    limits: BatchLimits
    controller: LingerController
    pending: list[Pending] = field(default_factory=list)
    inflight: int = 0  # batches released and not finished
    _tokens: int = 0

    @property
    def linger_s(self) -> float:
        return self.controller.linger_s

    def add(self, rid: str, tokens: int, now: float, urgent: bool = False) -> None:
        self.pending.append(Pending(rid, max(0, tokens), urgent, now))
        self._tokens += max(0, tokens)

    def remove(self, rid: str) -> bool:
        for i, p in enumerate(self.pending):
            if p.rid == rid:
                del self.pending[i]
                self._tokens -= p.tokens
                return True
        return False

    def __contains__(self, rid: str) -> bool:
        return any(p.rid == rid for p in self.pending)

    def __len__(self) -> int:
        return len(self.pending)

    def deadline(self) -> float | None:
        """When the linger of the oldest pending request closes (None: nothing pending, or
        nothing can go before a batch in flight finishes)."""
        if not self.pending or 0 < self.limits.max_inflight <= self.inflight:
            return None
        return self.pending[0].arrived + self.controller.linger_s

    def release(self, now: float, room: bool = True) -> list[Batch]:
        """The batches due now. ``room``: may the replica still take another dispatch (if not,
        nothing more can join: waiting is pointless)."""
        out: list[Batch] = []
        lim = self.limits
        while self.pending:
            why: Literal["size", "tokens", "urgent", "full", "window"] | None = None
            busy = 0 < lim.max_inflight <= self.inflight
            if busy:  # the engine is busy with its batches: only realtime goes now
                if any(p.urgent for p in self.pending):
                    why = "urgent"
            elif len(self.pending) >= lim.max_batch:
                why = "size"
            elif self._tokens >= lim.max_tokens:
                why = "tokens"
            elif any(p.urgent for p in self.pending):
                why = "urgent"
            elif not room:
                why = "full"
            elif now >= self.pending[0].arrived + self.controller.linger_s:
                why = "window"
            if why is None:
                break
            out.append(self._take(now, why))
        return out

    def _take(self, now: float, why: Literal["size", "tokens", "urgent", "full", "window"]
              ) -> Batch:
        lim = self.limits
        n = 0
        tokens = 0
        for p in self.pending:
            if n >= lim.max_batch or (n > 0 and tokens + p.tokens > lim.max_tokens):
                break
            n += 1
            tokens += p.tokens
        taken = self.pending[:n]
        del self.pending[:n]
        self._tokens -= tokens
        ahead = self.inflight
        self.inflight += 1
        return Batch(tuple(p.rid for p in taken), tokens, taken[0].arrived, now, why, ahead)

    def finished(self, now: float, batch: Batch) -> LingerDecision | None:
        """A released batch finished: its latency (from its oldest arrival) feeds the linger."""
        self.inflight = max(0, self.inflight - 1)
        return self.controller.on_batch(now, len(batch.rids), now - batch.opened, batch.ahead)


def make_controller(
    mode: str,
    *,
    linger_s: float = 0.0,
    floor_s: float = 0.010,
    ceiling_s: float = 0.100,
    target_s: float = 0.150,
    every: int = 10,
    alpha: float = 0.5,
) -> LingerController:
    """``off`` (no linger), ``fixed`` (``linger_s``) or ``adaptive``."""
    factories: dict[str, Callable[[], LingerController]] = {
        "off": lambda: FixedLinger(0.0),
        "fixed": lambda: FixedLinger(linger_s),
        "adaptive": lambda: AdaptiveLinger(floor_s, ceiling_s, target_s, every=every,
                                           alpha=alpha),
    }
    if mode not in factories:
        raise ValueError(f"unknown batch window mode {mode!r} (off, fixed, adaptive)")
    return factories[mode]()
