"""Precise cache-aware routing: the block index of each replica configured with ``kv_events``
follows its engine's real cache, and requests are keyed in the same space.

Each such replica gets a ``KVEventFeed`` whose changes go to ``Scheduler.observe_cache`` (and the
decisions that frees, to the driver). A request's keys must then be its token ids as the engine
sees them, in the engine's blocks: so the gateway asks a replica's ``POST /tokenize`` (the same
chat template as its ``/v1/chat/completions``), not a tokenizer of its own that could render the
template differently. That is one loopback round trip per request before it is queued; past
``tokenize_timeout_s``, on an error, or before the engine's block size is known (its first stored
block), the request keeps the keys hashed from its text, which simply match nothing there.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from qosgate.core.prefix import Prefix
from qosgate.core.scheduler import Scheduler
from qosgate.runtime.driver import Driver
from qosgate.runtime.kv_events import KVEventFeed
from qosgate.settings import UpstreamSettings
from qosgate.wire.engine_request import Route
from qosgate.wire.kv_events import CacheChange, token_prefix
from qosgate.wire.tokenize import tokenize_request

log = logging.getLogger("qosgate.kv_events")


class Tokenizing(Protocol):
    """An engine that can render and tokenize a request (``OpenAIUpstream``)."""

    @property
    def ready(self) -> bool: ...

    def models(self) -> list[str]: ...

    async def tokenize(self, request: bytes) -> list[int] | None: ...


class PreciseCache:
    """The event feeds of the replicas that publish KV events, and request keys in their space."""

    def __init__(
        self,
        feeds: dict[str, tuple[KVEventFeed, Tokenizing]],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.feeds = feeds
        self._turn = itertools.count()
        self.clock = clock
        self.tokenized = 0
        self.fallbacks = 0  # requests left with their text keys
        self.tokenize_s = 0.0  # time spent in /tokenize calls, all told

    @classmethod
    def build(
        cls,
        upstreams: Sequence[tuple[str, UpstreamSettings, Tokenizing]],
        scheduler: Scheduler,
        driver: Driver,
    ) -> PreciseCache | None:
        """One feed per upstream with ``kv_events``; None if none has."""
        feeds: dict[str, tuple[KVEventFeed, Tokenizing]] = {}
        for name, cfg, engine in upstreams:
            if cfg.kv_events is None:
                continue

            def observe(change: CacheChange, name: str = name) -> None:
                driver.apply(scheduler.observe_cache(
                    name, driver.clock(), stored=change.stored, removed=change.removed,
                    cleared=change.cleared,
                ))

            feeds[name] = (KVEventFeed(name, cfg.kv_events, observe, cfg.kv_events_topic),
                           engine)
        return cls(feeds) if feeds else None

    def start(self) -> None:
        for feed, _ in self.feeds.values():
            feed.start()

    async def close(self) -> None:
        for feed, _ in self.feeds.values():
            await feed.close()
        log.info("%s", self.summary())

    def summary(self) -> str:
        """What precise mode did: requests keyed by token ids (and the /tokenize time they
        cost), those left with their text keys, and each feed's batches and losses."""
        mean_ms = 1000 * self.tokenize_s / self.tokenized if self.tokenized else 0.0
        feeds = "; ".join(
            f"{name}: {f.batches} batches, {f.lost} lost, {f.restarts} restarts, "
            f"{f.skipped} blocks skipped" for name, (f, _) in self.feeds.items())
        return (f"precise cache routing: {self.tokenized} requests keyed by their token ids "
                f"(/tokenize {mean_ms:.1f} ms mean), {self.fallbacks} kept their text keys; "
                f"{feeds}")

    async def prefix_of(self, body: bytes, route: Route, model: str) -> Prefix | None:
        """``body``'s keys from its token ids, as a replica serving ``model`` tokenizes it
        (taken in turn); None: keep the text's keys."""
        ready = [(feed, eng) for feed, eng in self.feeds.values()
                 if eng.ready and feed.block_size is not None and model in eng.models()]
        if not ready:
            return None
        feed, engine = ready[next(self._turn) % len(ready)]
        block = feed.block_size
        assert block is not None
        ask = tokenize_request(body, route)
        if ask is None:
            return None
        if isinstance(ask, list):
            return token_prefix(ask, block)
        t = self.clock()
        ids = await engine.tokenize(ask)
        self.tokenize_s += self.clock() - t
        if ids is None:
            self.fallbacks += 1
            return None
        self.tokenized += 1
        return token_prefix(ids, block)
