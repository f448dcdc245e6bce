"""The composition root: the gateway's object graph built from its config, in one place.

``build_gateway`` makes the engines (upstream replicas or the built-in one), the scheduler over
them, shared tenant state, embeddings batching, the driver, the request flow and the Batch API's
directory, store, routes and feeder, and hands them to ``Gateway`` (``server/app.py``), which
routes requests to them and runs their life (start-up, shutdown).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import msgspec

from qosgate.config import QosConfig
from qosgate.core import ReplicaSpec, Request, Scheduler
from qosgate.core.ledger import LeasedLedger
from qosgate.core.peers import load_of
from qosgate.models.simmodel import SimEngine, load_profile
from qosgate.models.token_times import apply_profiles
from qosgate.runtime.batches.directory import BatchDirectory, batch_directory
from qosgate.runtime.batches.feeder import Feeder
from qosgate.runtime.batches.lease import Lease, LocalLease, RedisLease
from qosgate.runtime.batches.store import BatchStore
from qosgate.runtime.driver import Driver
from qosgate.runtime.embedded import llamacpp_from_settings
from qosgate.runtime.inprocess import InProcessEngine
from qosgate.runtime.ports import Engine
from qosgate.runtime.precise import PreciseCache
from qosgate.runtime.shared_state import InstanceInfo, RedisStore, SharedState, new_instance_id
from qosgate.runtime.upstream.replica import OpenAIUpstream
from qosgate.server.app import Gateway, GatewayParts
from qosgate.server.batches import BatchRoutes
from qosgate.server.batches_lines import FlowLines
from qosgate.server.catalog import Catalog
from qosgate.server.flow import RequestFlow
from qosgate.server.metrics import BatchingCollector, BatchJobsCollector, GatewayMetrics
from qosgate.server.passthrough import PassThrough
from qosgate.server.upstreams import Upstreams, embeddings_batching
from qosgate.settings import GatewaySettings, RedisSettings

DEFAULT_SIM_WINDOW = 64
Clock = Callable[[], float]


def build_gateway(cfg: QosConfig, settings: GatewaySettings, policy: str | None = None,
                  worker: tuple[str, int] | None = None) -> Gateway:
    """The gateway, its batch directory taken first: a directory another deployment holds
    (``DirectoryRefused``) stops start-up before a model is loaded. ``worker``: (group, index)
    of a process of ``serve --workers``."""
    batch_dir = None
    if settings.batches.enabled:
        batch_dir = batch_directory(settings, settings.redis.instance_id or new_instance_id(),
                                    worker)
        batch_dir.claim()
    try:
        return Gateway(assemble(cfg, settings, build_engines(settings), policy, batch_dir))
    except BaseException:
        if batch_dir is not None:
            batch_dir.release()
        raise


def build_engines(settings: GatewaySettings) -> dict[str, Engine]:
    engines: dict[str, Engine] = {}
    if settings.upstreams:
        for i, u in enumerate(settings.upstreams):
            up = OpenAIUpstream(u, i)
            if up.name in engines:
                raise ValueError(f"two upstreams are named {up.name!r}")
            engines[up.name] = up
        return engines
    es = settings.engine
    if es.kind == "llamacpp":
        llama = llamacpp_from_settings(es)
        return {llama.name: llama}
    prof = load_profile(es.profile)
    if es.max_num_seqs is not None:
        prof = prof.model_copy(update={"max_num_seqs": es.max_num_seqs})
    # the engine orders by the band too (vLLM polarity) when its KV cache is contended
    sim = SimEngine(prof, "priority")
    engines["sim-0"] = InProcessEngine(
        sim,
        name="sim-0",
        max_window=es.max_window or min(prof.max_num_seqs, DEFAULT_SIM_WINDOW),
        models=[es.served_model_name or "qosgate-sim"],
        modelled_time=True,
        time_scale=es.time_scale,
        pausable=es.pausable,
        eos_after=es.eos_after,
    )
    return engines


def assemble(cfg: QosConfig, settings: GatewaySettings, engines: dict[str, Engine],
             policy: str | None = None, batch_dir: BatchDirectory | None = None
             ) -> GatewayParts:
    """Everything the gateway is built of, wired together. ``batch_dir``: where the Batch API
    keeps its jobs, already claimed (``build_gateway``); default: this gateway's
    (``batch_directory``), claimed at start-up."""
    clock = time.monotonic
    rs = settings.redis
    instance = rs.instance_id or new_instance_id()
    ledger = LeasedLedger() if rs.url else None
    # precise mode: the replicas whose index follows their engine's KV events
    upstreams = [(e.name, e.cfg, e) for e in engines.values() if isinstance(e, OpenAIUpstream)]
    with_events = {name for name, u, _ in upstreams if u.kv_events is not None}
    scheduler = Scheduler(
        cfg,
        policy,
        [
            # an in-process engine's window is its batch (it is scheduled here, token by
            # token); an upstream's adapts to what the engine reports of its own load
            ReplicaSpec(name, e.max_window, e.pausable, models=tuple(e.models()),
                        ordered=e.ordered, cache_events=name in with_events,
                        resumes=e.resumes)
            for name, e in engines.items()
        ],
        ledger=ledger,
    )
    apply_profiles(scheduler.pricing.weights, cfg.models, cfg.fairness.reference_model)
    metrics = GatewayMetrics(scheduler, clock)
    shared = _shared_state(rs, ledger, scheduler, instance, clock)
    if shared is not None:
        metrics.registry.register(shared)
    metrics.registry.register(InstanceInfo(instance, "redis" if rs.url else "none"))
    batching = embeddings_batching(settings.embeddings, engines, scheduler, clock)
    metrics.registry.register(BatchingCollector(batching))

    def on_finished(req: Request) -> None:
        """A request ended (driver hook): the metrics, and a slot freed (a batch waiting for
        room may be due)."""
        metrics.observe(req)
        for b in batching:
            b.room_changed()

    batched = {b.name: b for b in batching}
    driver = Driver(scheduler, {name: batched.get(name, e) for name, e in engines.items()},
                    clock=clock, on_finished=on_finished, on_cached=metrics.prompt_cache)
    precise = PreciseCache.build(upstreams, scheduler, driver)
    catalog = Catalog(engines, clock, scheduler.fleet.adapters_of)
    flow = RequestFlow(cfg, settings, engines, scheduler, driver, metrics, catalog.models,
                       catalog.context, precise)
    metrics.cap_tenants(settings.server.metrics_max_tenants)
    passthrough = PassThrough(engines, functools.partial(_authorize, scheduler),
                              flow.new_request_id, metrics.passed,
                              settings.server.max_body_bytes)
    bs = settings.batches  # the Batch API: its directory is taken, its store opened at start
    batch_dir = (batch_dir or batch_directory(settings, instance)) if bs.enabled else None
    store = (BatchStore(batch_dir.path, time.time, bs.max_lines) if batch_dir is not None
             else None)
    routes = (BatchRoutes(cfg, settings, store, scheduler, metrics)
              if store is not None else None)
    # the feeder runs the jobs' lines through the flow; the routes wake it
    feeder: Feeder | None = None
    if batch_dir is not None and batch_dir.feeds and store is not None and routes is not None:
        lease: Lease = (RedisLease(rs.url, instance, bs.lease_ttl_s, rs.prefix)
                        if rs.url else LocalLease())
        feeder = Feeder(store, FlowLines(flow, cfg), lease, bs,
                        functools.partial(_fleet_window, scheduler),
                        lambda m: m in catalog.models(), lambda: len(scheduler.requests),
                        time.time, clock)
        routes.on_created = routes.on_cancel = feeder.notify
        metrics.registry.register(BatchJobsCollector(feeder))
    return GatewayParts(
        cfg=cfg, settings=settings, engines=engines, catalog=catalog, clock=clock,
        instance=instance, scheduler=scheduler, metrics=metrics, shared=shared,
        batching=batching, driver=driver, precise=precise, flow=flow, batch_dir=batch_dir,
        batch_store=store, batch_routes=routes, feeder=feeder, passthrough=passthrough,
        upstreams=Upstreams(engines, driver, scheduler, batching, settings.embeddings, clock),
    )


def _authorize(scheduler: Scheduler, key: str | None) -> None:
    """Raises ``QosInputError`` for a key the gateway refuses (none: it runs open)."""
    if not scheduler.classifier.open:
        scheduler.classifier.tenant_for(key)


def _shared_state(rs: RedisSettings, ledger: LeasedLedger | None, scheduler: Scheduler,
                  instance: str, clock: Clock) -> SharedState | None:
    """Tenant state shared through Redis (docs/guides/several-instances.md): leased budgets
    synced with the other instances; None without ``redis.url``."""
    if not rs.url or ledger is None:
        return None
    shared = SharedState(
        RedisStore(rs.url, rs.prefix, rs.timeout_s), ledger, clock,
        scheduler.policy.root, instance, rs.sync_interval_s, rs.lease_ttl_s,
        rs.fail_open, rs.degrade_after_s,
        info=lambda: msgspec.json.encode({
            "queued_total": scheduler.queued_total,
            "inflight": len(scheduler.requests) - scheduler.queued_total,
        }).decode(),
        load=lambda: load_of(scheduler, clock()),
    )
    # admission predicts from the fleet's queue and completion rate: this instance's and the
    # others' as their heartbeats say
    scheduler.admission.peers = shared.protocol.peers
    return shared


def _fleet_window(scheduler: Scheduler) -> int:
    """Requests the fleet runs at once (the replicas' windows): a batch job keeps this many
    lines in flight, and its queue, so that it fills an idle fleet."""
    return sum(rep.window for rep in scheduler.replicas.values())
