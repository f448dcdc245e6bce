"""The upstream replicas a gateway runs, and how a reload changes them (``Upstreams``).

A reload adds the upstreams its file names anew: each is built as start-up builds one (its
embeddings batched as start-up batches them), handed to the scheduler and the driver, and
probed on the driver's next round before it takes work. An upstream the file no longer names is
retired: it takes no new work, the requests it runs finish there, and its models leave
``/v1/models`` (unless another replica serves them). An upstream whose settings changed under
the same name, or one that follows KV-cache events, is kept as it runs until a restart: its
window, its pool and its event subscription are not swapped under running requests.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

from qosgate.core import ReplicaSpec, Scheduler
from qosgate.core.batching import Batcher, BatchLimits, make_controller
from qosgate.runtime.batching import BatchingEngine
from qosgate.runtime.driver import Driver
from qosgate.runtime.ports import Engine
from qosgate.runtime.upstream.replica import OpenAIUpstream
from qosgate.server.reload import Changes
from qosgate.settings import EmbeddingsSettings, UpstreamSettings, upstream_name

log = logging.getLogger("qosgate.gateway")
Clock = Callable[[], float]


def embeddings_batching(es: EmbeddingsSettings, engines: dict[str, Engine],
                        scheduler: Scheduler, clock: Clock) -> list[BatchingEngine]:
    """Embeddings: the calls of a replica whose engine serves batches are batched by a
    decorator over it (runtime/batching.py), lingering per core/batching.py."""
    return [
        BatchingEngine(
            e,  # type: ignore[arg-type]
            Batcher(
                BatchLimits(es.max_batch, es.max_batch_tokens, es.max_inflight_batches),
                make_controller(es.linger, linger_s=es.linger_ms / 1000,
                                floor_s=es.floor_ms / 1000, ceiling_s=es.ceiling_ms / 1000,
                                target_s=es.target_ms / 1000, every=es.every, alpha=es.alpha),
            ),
            functools.partial(_room, scheduler, name), clock, es.urgent_levels,
        )
        for name, e in engines.items() if getattr(e, "embeds", False)
    ]


def _room(scheduler: Scheduler, replica: str) -> bool:
    """May ``replica`` still take another dispatch (its batcher's question)."""
    rep = scheduler.replicas.get(replica)
    return rep is not None and rep.free > 0


class Upstreams:
    """What a reload changes of the replicas: the engines every part reads (one dict, shared
    with the catalog, the request flow and the pass-through), the driver's, the scheduler's
    replicas and the embeddings batchers (one list, shared with their metrics)."""

    def __init__(self, engines: dict[str, Engine], driver: Driver, scheduler: Scheduler,
                 batching: list[BatchingEngine], embeddings: EmbeddingsSettings,
                 clock: Clock) -> None:
        self.engines = engines
        self.driver = driver
        self.scheduler = scheduler
        self.batching = batching
        self.embeddings = embeddings
        self.clock = clock

    def apply(self, found: Changes, new: tuple[UpstreamSettings, ...]) -> None:
        """Add and retire what ``found`` says (``server/reload.py`` decided it)."""
        named = {upstream_name(u, i): (u, i) for i, u in enumerate(new)}
        for name in found.upstreams_added:
            u, i = named[name]
            self._add(OpenAIUpstream(u, i))
        if found.upstreams_added:
            # make before break: the new ones are probed first (up, or found down), then the
            # old ones retire, so that a fleet swapped whole never has no replica at all
            self.driver.loop().create_task(self._retire_after_probe(found.upstreams_retired))
        else:
            self._retire(found.upstreams_retired)

    async def _retire_after_probe(self, names: tuple[str, ...]) -> None:
        try:
            await self.driver.probe_all()
        finally:
            self._retire(names)

    def _retire(self, names: tuple[str, ...]) -> None:
        for name in names:
            self.engines.pop(name, None)  # gone from the catalog, the flow, the pass-through
            self.driver.apply(self.scheduler.retire_replica(name, self.clock()))

    def _add(self, engine: OpenAIUpstream) -> None:
        name = engine.name
        if name in self.scheduler.replicas:  # retired earlier: a restart brings it back
            log.warning("upstream %s was retired by an earlier reload; a restart adds it "
                        "again", name)
            return
        self.engines[name] = engine
        batched = embeddings_batching(self.embeddings, {name: engine}, self.scheduler,
                                      self.clock)
        self.batching.extend(batched)
        self.driver.engines[name] = batched[0] if batched else engine
        # down until the driver's next probe round finds it up
        self.scheduler.add_replica(ReplicaSpec(name, engine.max_window, engine.pausable,
                                               models=tuple(engine.models()),
                                               ordered=engine.ordered, up=False,
                                               resumes=engine.resumes))
        for b in batched:
            self.driver.loop().create_task(b.start())
