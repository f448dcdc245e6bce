"""``cache-aware``: where the prompt's prefix is cached, weighed in time against load, with
``session-affinity``'s load release (``core.routing.session_affinity``).

The anchors (``../shared/research/fleet.md``) score blocks (Dynamo: prefill blocks less overlap
plus decode blocks) or filter by a match threshold then balance (llm-d, SMG). This one costs
each replica in *time*, the quantity TTFT is made of:

    (uncached prompt tokens queued on it + (1 + recompute_weight) x this prompt's uncached
     part) / prefill rate + decode_load_s x its window in use (running decodes, engine queue)

where the cached part is what the per-replica index says (``core.routing.prefix_index``) and
the queued part counts only what each earlier request was expected *not* to find cached (a warm
replica with a long queue of cache hits is not busy). The prompt's own uncached part counts
more than once: its TTFT alone would send it to the replica with the shortest queue, but the
prefill a cold replica redoes delays every request behind it, fleet-wide (near capacity that
extra work tipped the engines into KV preemptions and recomputation).

It does better than the anchors in four ways: (1) when no candidate is warm for the prompt it
is exactly ``least-load`` (so it cannot lose where little is shared, the failure of sglang
#21199); (2) the release is relative to the fleet's mean, not an absolute count, and a
released replica is passed over, not merely costed as cold; (3) QoS: a strict (realtime)
request takes a warm replica only where its TTFT budget holds (the predicted queued prefill
there fits the class's budget) and its TPOT holds (the engine's time per token within the
class's budget, as ``least-load-spread`` steers); the reserve, prefill budget and TPOT guard
filter before any router; (4) a request of a class with a long TTFT budget (batch, offline)
may wait briefly for its warm replica while that one is full, no longer than ``warm_wait_s``
nor than the prefill it would save (then it goes anywhere; the scheduler wakes at that bound,
``wake_at``). Sessions are a strong hint: a session's last turn's prompt counts as cached
where it ran when the request carries no block keys.

A **KV bound** comes before all of it, for the classes that are not strict: a replica is a
candidate only while the prompts in flight there, with this one, fit ``kv_fill`` of its KV
cache (``replica_kv_tokens``); where none has room the request stays in qosgate's queue until
one does, at most ``kv_wait_s``. Why: near capacity with long prompts the window alone lets an
engine's KV overflow, and the engine then preempts running sequences (a higher-priority prompt
evicts a lower one's decode) and computes their prompts again; that wasted prefill is what
tips the fleet from keeping up into collapse, whatever the placement rule. In qosgate's queue
a request waits in QoS order and costs nothing. A strict (realtime) request is never held:
its engine priority is how it gets its TTFT.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from qosgate.core.routing.base import RouterContext, cold_load
from qosgate.core.routing.holds import Holds
from qosgate.core.routing.least_load import LeastLoadRouter
from qosgate.core.routing.least_load_spread import misses_tpot
from qosgate.core.routing.prefix_index import PrefixIndex
from qosgate.core.routing.session_affinity import Row, SessionAffinityRouter
from qosgate.core.routing.sessions import Binding

if TYPE_CHECKING:
    from qosgate.core.replica import Replica
    from qosgate.core.request import Request


class CacheAwareRouter(SessionAffinityRouter):
    """Where the prompt's prefix is cached, weighed in time against load (module docstring)."""

    name = "cache-aware"
    reads_prefix = True

    def __init__(self, ctx: RouterContext) -> None:
        super().__init__(ctx)
        cache = ctx.cache
        self.index = PrefixIndex(cache.replica_cache_tokens)
        self.prefill_rate = cache.prefill_tokens_per_s
        self.decode_load_s = cache.decode_load_s
        self.own_weight = 1.0 + cache.recompute_weight
        self.warm_wait_s = cache.warm_wait_s
        self.strict_ttft_s = dict(ctx.strict_ttft_s)
        self.strict_tpot_s = dict(ctx.strict_tpot_s)
        self.may_wait = ctx.may_wait_levels if cache.warm_wait_s > 0 else frozenset()
        # uncached prompt tokens sent to each replica and not answered yet, and each such
        # request's part of them
        self.queued_uncached: dict[str, int] = {}
        self._uncached: dict[str, tuple[str, int]] = {}
        # requests left queued for their warm replica
        self._waiting = Holds()
        # the prompt tokens a replica's in-flight requests may hold (None: no bound), and the
        # requests left queued for want of it
        kv_fill = cache.kv_fill
        kv = cache.replica_kv_tokens or cache.replica_cache_tokens
        self.kv_room = None if kv_fill is None else kv_fill * kv
        self.kv_wait_s = cache.kv_wait_s
        self._kv_held = Holds()

    # ------------------------------------------------------------------ placement
    def pick(self, req: Request, candidates: Sequence[Replica], now: float) -> Replica | None:
        if self.kv_room is None or req.class_level in self.strict_ttft_s:
            return self._pick(req, candidates, now)
        until = self._kv_held.get(req.id)
        if until is not None and now >= until:  # waited its bound: anywhere
            return self._pick(req, candidates, now)
        fits = [rep for rep in candidates if self.kv_fits(req, rep)]
        rep = self._pick(req, fits, now) if fits else None
        if rep is None and until is None and len(fits) < len(candidates):
            self._kv_held.hold(req.id, now + self.kv_wait_s, now)
        return rep

    def _pick(self, req: Request, candidates: Sequence[Replica], now: float) -> Replica | None:
        """Where ``req`` goes among ``candidates`` (those within the KV bound), or None."""
        binding = self._binding(req, now)
        cached = [self.cached(req, rep, binding) for rep in candidates]
        if not any(cached):  # nothing warm for this prompt: exactly least-load
            return LeastLoadRouter.pick(self, req, candidates, now)
        rows = self.rows(req, candidates, now)
        if not rows:
            return None  # every window is full
        if self._waits_for_warm(req, candidates, cached, rows, now):
            return None
        warm = dict(zip([r.name for r in candidates], cached, strict=True))
        bound = self.release_bound(rows)
        # a warm replica past the release is passed over (while another has room)
        kept = [row for row in rows if not (warm[row[0].name] and row[2] > bound)] or rows
        best: Replica | None = None
        best_key = (True, math.inf)
        for rep, saturated, score in kept:
            hit = warm[rep.name]
            if hit and (saturated or score > bound or not self._qos_holds(req, rep, hit)):
                hit = 0  # no affinity where the request's budgets would not hold
            key = (saturated, self.cost(req, rep, hit))
            if key < best_key:
                best, best_key = rep, key
        return best

    def kv_fits(self, req: Request, rep: Replica) -> bool:
        """``req``'s prompt fits ``rep``'s KV bound beside the prompts in flight there (a
        replica with nothing in flight takes any prompt: the engine says if it cannot)."""
        if not rep.inflight or self.kv_room is None:
            return True
        # (summed from the window, not kept as books: a paused request resuming is not placed)
        held = req.prompt_tokens
        for other in rep.inflight.values():
            held += other.prompt_tokens
        return held <= self.kv_room

    def cached(self, req: Request, rep: Replica, binding: Binding | None) -> int:
        """Prompt tokens of ``req`` that ``rep`` is expected to hold."""
        prefix = req.prefix
        if prefix is not None:
            hit = self.index.match(rep.name, prefix) * prefix.block_tokens
        elif binding is not None and binding.replica == rep.name:
            hit = binding.prompt_tokens  # the last turn's prompt leads this one's
        else:
            return 0
        # the engine computes at least the prompt's last token
        return hit if hit < req.prompt_tokens else max(0, req.prompt_tokens - 1)

    def cost(self, req: Request, rep: Replica, hit: int) -> float:
        """Seconds ``req`` is expected to cost on ``rep``: queued and own uncached prefill at
        the prefill rate (its own counted ``1 + recompute_weight`` times: what it recomputes
        delays the fleet's other requests too), plus the replica's window in use weighed by
        ``decode_load_s``. A LoRA adapter's load where it is cold counts as own prefill."""
        own = req.prompt_tokens - hit + cold_load(req, rep)
        prefill = self.queued_uncached.get(rep.name, 0) + own * self.own_weight
        sig = rep.signals
        busy = len(rep.inflight) + 1
        if sig is not None and sig.waiting:
            busy += sig.waiting
        return prefill / self.prefill_rate + self.decode_load_s * busy / max(1, rep.window)

    def _qos_holds(self, req: Request, rep: Replica, hit: int) -> bool:
        """A strict request's budgets hold on ``rep``: its predicted queued prefill there
        within its TTFT budget, the engine's time per token within its TPOT budget."""
        ttft = self.strict_ttft_s.get(req.class_level)
        if ttft is None:
            return True
        prefill = self.queued_uncached.get(rep.name, 0) + req.prompt_tokens - hit
        if prefill / self.prefill_rate > ttft:
            return False
        tpot = self.strict_tpot_s.get(req.class_level)
        return tpot is None or not misses_tpot(rep, tpot)

    def _waits_for_warm(self, req: Request, candidates: Sequence[Replica], cached: list[int],
                        rows: Sequence[Row], now: float) -> bool:
        """Whether ``req`` stays queued for its warmest replica, full now: only a class that
        may wait, only while that replica is not saturated, and until the bound set the first
        time it waited (``warm_wait_s``, and no longer than the prefill it would save)."""
        if req.class_level not in self.may_wait:
            return False
        with_room = {rep.name for rep, _, _ in rows}
        best_hit, best_room = max(
            ((hit, rep.name in with_room) for rep, hit in zip(candidates, cached, strict=True)),
            key=lambda pair: pair[0])
        until = self._waiting.get(req.id)
        if best_room or not best_hit:
            return False
        if until is None:
            until = now + min(self.warm_wait_s, best_hit / self.prefill_rate)
            self._waiting.hold(req.id, until, now)
        return now < until

    # ------------------------------------------------------------------ the books
    def placed(self, req: Request, rep: Replica, now: float) -> int:
        self._kv_held.release(req.id)
        hit = self.cached(req, rep, self._binding(req, now))
        super().placed(req, rep, now)
        if req.prefix is not None:
            self.index.placed(rep.name, req.prefix)
        uncached = req.prompt_tokens - hit
        self.queued_uncached[rep.name] = self.queued_uncached.get(rep.name, 0) + uncached
        self._uncached[req.id] = (rep.name, uncached)
        self._waiting.release(req.id)
        return hit

    def started(self, req: Request, rep: Replica) -> None:
        self._unqueue(req)

    def left(self, req: Request, rep: Replica) -> None:
        self._unqueue(req)

    def _unqueue(self, req: Request) -> None:
        was = self._uncached.pop(req.id, None)
        if was is not None:
            self.queued_uncached[was[0]] -= was[1]

    def follow_events(self, name: str) -> None:
        self.index.follow_events(name)

    def cache_lost(self, name: str, now: float) -> None:
        super().cache_lost(name, now)
        self.index.lost(name)

    def observe_cache(self, name: str, now: float, stored: Sequence[int],
                      removed: Sequence[int], cleared: bool) -> None:
        self.index.observe(name, stored, removed, cleared)

    def holds(self, req: Request, now: float) -> bool:
        return self._waiting.holds(req.id, now) or self._kv_held.holds(req.id, now)

    def wake_at(self, now: float) -> float:
        return min(self._waiting.next_after(now), self._kv_held.next_after(now))
