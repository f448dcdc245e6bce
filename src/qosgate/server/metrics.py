"""Prometheus metrics (``GET /metrics``), all prefixed ``qosgate_``.

Counts come from one source of truth: a custom collector reads the core's ``outcomes`` ledger (plus
the gateway's own ledger of requests refused before they reached the scheduler: bad JSON, bad key,
unknown model, ...) at scrape time, so ``qosgate_requests_total`` equals the outcomes exactly.

- ``qosgate_requests_total{class,tenant,outcome,reason}``: every terminal outcome;
- ``qosgate_queue_wait_seconds{class}``, ``qosgate_ttft_seconds{class}``,
  ``qosgate_e2e_seconds{class}``: histograms (arrival to dispatch / first token / completion);
- ``qosgate_queue_depth{class}``, ``qosgate_queue_oldest_wait_seconds{class}``,
  ``qosgate_inflight{class}``: gauges per class;
- ``qosgate_tenant_queued{tenant}``, ``qosgate_tenant_inflight{tenant}``;
- ``qosgate_replica_inflight{replica}``, ``qosgate_replica_capacity{replica}``,
  ``qosgate_replica_up{replica}`` (its last probe answered), ``qosgate_replica_eligible{replica}``
  (may take work now: up, not cooling, not ejected), ``qosgate_replica_breaker_open{replica}``,
  ``qosgate_replica_cooling_seconds{replica}``, ``qosgate_replica_ejections_total{replica}``,
  ``qosgate_replica_ttft_seconds{replica}`` (histogram);
- ``qosgate_attempt_failures_total{class,replica,reason}``: engine calls that failed before the
  first byte (``upstream_unreachable``, ``upstream_503``, ``first_byte_timeout``, ...), and
  ``qosgate_retries_total{class,replica,reason}`` those of them retried elsewhere;
- ``qosgate_preemptions_total{class}``: requests pulled back (paused or aborted) for a more
  urgent one.

Timeouts are outcomes: ``qosgate_requests_total{outcome="timed_out", reason=...}`` with reason
``queue_timeout``, ``first_byte_timeout``, ``idle_timeout`` or ``total_timeout``.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from qosgate.core import Request, Scheduler, State
from qosgate.runtime.batches import SIZE_BUCKETS, BatchRunner

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0
)

# the gateway's own ledger, same key as the core's: (class, tenant, outcome, reason)
Ledger = Counter[tuple[str, str, str, str]]


class _HistogramCollector:
    def __init__(self, histograms: tuple[_Histogram, ...]) -> None:
        self.histograms = histograms

    def collect(self) -> Iterator[Metric]:
        for h in self.histograms:
            yield h.collect()


OTHER_TENANT = "other"


class TenantLabels:
    """The ``tenant`` label of a tenant: its name for the first ``max_tenants`` tenants of the
    config (and the default and ``unknown`` pseudo-tenants), ``other`` for the rest, so that a
    config with thousands of tenants cannot blow up the series count of every scrape."""

    def __init__(self, scheduler: Scheduler, max_tenants: int = 100) -> None:
        cfg = scheduler.cfg
        names = [t.name for t in cfg.tenants[:max_tenants]]
        self.known = frozenset([*names, cfg.default_tenant, "unknown", "none"])
        self.capped = len(cfg.tenants) > max_tenants

    def __call__(self, tenant: str) -> str:
        return tenant if tenant in self.known else OTHER_TENANT


class _StateCollector:
    def __init__(
        self,
        scheduler: Scheduler,
        ledger: Ledger,
        clock: Callable[[], float],
    ) -> None:
        self.scheduler = scheduler
        self.ledger = ledger
        self.clock = clock
        self.tenant_label = TenantLabels(scheduler)

    def collect(self) -> Iterator[Metric]:
        sched = self.scheduler
        total = CounterMetricFamily(
            "qosgate_requests",
            "Requests by terminal outcome (completed, rejected, timed_out, cancelled, failed).",
            labels=["class", "tenant", "outcome", "reason"],
        )
        merged: Ledger = Counter(sched.outcomes)
        merged.update(self.ledger)
        label = self.tenant_label
        if label.capped:
            capped: Ledger = Counter()
            for (cls, tenant, outcome, reason), n in merged.items():
                capped[(cls, label(tenant), outcome, reason)] += n
            merged = capped
        for (cls, tenant, outcome, reason), n in sorted(merged.items()):
            total.add_metric([cls, tenant, outcome, reason], n)
        yield total

        snap = sched.snapshot(self.clock(), tenants=True)
        depth = GaugeMetricFamily("qosgate_queue_depth", "Queued requests.", labels=["class"])
        oldest = GaugeMetricFamily(
            "qosgate_queue_oldest_wait_seconds", "Wait of the oldest queued request.",
            labels=["class"],
        )
        inflight = GaugeMetricFamily(
            "qosgate_inflight", "Requests at an engine.", labels=["class"]
        )
        for c in snap.classes:
            depth.add_metric([c.name], c.queued)
            oldest.add_metric([c.name], c.oldest_wait_s)
            inflight.add_metric([c.name], c.inflight)
        yield depth
        yield oldest
        yield inflight
        per_tenant: dict[str, list[int]] = {}
        for row in snap.tenants:
            acc = per_tenant.setdefault(label(row.tenant), [0, 0])
            acc[0] += row.queued
            acc[1] += row.inflight
        tq = GaugeMetricFamily("qosgate_tenant_queued", "Queued requests.", labels=["tenant"])
        ti = GaugeMetricFamily("qosgate_tenant_inflight", "Requests at an engine.",
                               labels=["tenant"])
        for name, (q, i) in per_tenant.items():
            tq.add_metric([name], q)
            ti.add_metric([name], i)
        yield tq
        yield ti
        gauges = {
            "inflight": GaugeMetricFamily("qosgate_replica_inflight", "Requests in flight.",
                                          labels=["replica"]),
            "capacity": GaugeMetricFamily("qosgate_replica_capacity", "In-flight window.",
                                          labels=["replica"]),
            "up": GaugeMetricFamily("qosgate_replica_up", "1 if its last health probe answered.",
                                    labels=["replica"]),
            "eligible": GaugeMetricFamily(
                "qosgate_replica_eligible", "1 if it may take work now (up, not cooling, "
                "not ejected).", labels=["replica"]),
            "open": GaugeMetricFamily("qosgate_replica_breaker_open",
                                      "1 while outlier detection has it ejected.",
                                      labels=["replica"]),
            "cooling": GaugeMetricFamily(
                "qosgate_replica_cooling_seconds",
                "Back-pressure (429/503 Retry-After) left before it takes work again.",
                labels=["replica"]),
        }
        ejections = CounterMetricFamily("qosgate_replica_ejections", "Outlier ejections.",
                                        labels=["replica"])
        for r in snap.replicas:
            gauges["inflight"].add_metric([r.name], r.inflight)
            gauges["capacity"].add_metric([r.name], r.window)
            gauges["up"].add_metric([r.name], 1.0 if r.up else 0.0)
            gauges["eligible"].add_metric([r.name], 1.0 if r.eligible else 0.0)
            gauges["open"].add_metric([r.name], 1.0 if r.breaker == "open" else 0.0)
            gauges["cooling"].add_metric([r.name], r.cooling_s)
            ejections.add_metric([r.name], r.ejections)
        yield from gauges.values()
        yield ejections
        fails = CounterMetricFamily(
            "qosgate_attempt_failures",
            "Engine calls that failed before the first byte reached the client.",
            labels=["class", "replica", "reason"],
        )
        for cls, rep, reason, n in snap.attempt_failures:
            fails.add_metric([cls, rep, reason], n)
        yield fails
        retries = CounterMetricFamily(
            "qosgate_retries", "Failed attempts retried on another replica.",
            labels=["class", "replica", "reason"],
        )
        for cls, rep, reason, n in snap.retries:
            retries.add_metric([cls, rep, reason], n)
        yield retries
        pre = CounterMetricFamily(
            "qosgate_preemptions", "Requests pulled back for a more urgent one.",
            labels=["class"],
        )
        for cls, n in snap.preemptions:
            pre.add_metric([cls], n)
        yield pre


class _Histogram:
    """A histogram by class, observed on the event loop thread only.

    prometheus_client's ``Histogram`` takes a lock per increment and walks its buckets in Python,
    and ``labels()`` builds a key per call: about 10 us per request for the three histograms. This
    one is a list of counts per class (``bisect`` finds the bucket) rendered at scrape time, with
    the same samples (``_bucket``, ``_count``, ``_sum``, ``_created``).
    """

    __slots__ = ("bounds", "by_class", "doc", "label", "les", "name")

    def __init__(
        self, name: str, doc: str, bounds: tuple[float, ...], label: str = "class"
    ) -> None:
        self.name = name
        self.label = label
        self.doc = doc
        self.bounds = bounds
        self.les = [floatToGoString(b) for b in bounds] + ["+Inf"]  # type: ignore[no-untyped-call]
        # class -> (counts per bucket, the last one +Inf; [sum, created])
        self.by_class: dict[str, tuple[list[int], list[float]]] = {}

    def observe(self, cls: str, value: float) -> None:
        child = self.by_class.get(cls)
        if child is None:
            child = self.by_class[cls] = ([0] * (len(self.bounds) + 1), [0.0, time.time()])
        child[0][bisect_left(self.bounds, value)] += 1
        child[1][0] += value

    def collect(self) -> Metric:
        fam = HistogramMetricFamily(self.name, self.doc, labels=[self.label])
        name = self.name + "_created"
        for cls, (counts, (total, created)) in self.by_class.items():
            acc = 0
            buckets = []
            for le, n in zip(self.les, counts, strict=True):
                acc += n
                buckets.append((le, float(acc)))
            fam.add_metric([cls], buckets, total)
            fam.add_sample(name, {self.label: cls}, created)
        return fam


class GatewayMetrics:
    def __init__(
        self,
        scheduler: Scheduler,
        clock: Callable[[], float],
    ) -> None:
        self.ledger: Ledger = Counter()
        self.registry = CollectorRegistry(auto_describe=False)
        self.queue_wait = _Histogram(
            "qosgate_queue_wait_seconds", "Arrival to (last) dispatch.", LATENCY_BUCKETS
        )
        self.ttft = _Histogram("qosgate_ttft_seconds", "Arrival to first token.", LATENCY_BUCKETS)
        self.e2e = _Histogram(
            "qosgate_e2e_seconds", "Arrival to completion (completed requests).", LATENCY_BUCKETS
        )
        self.replica_ttft = _Histogram(
            "qosgate_replica_ttft_seconds", "Dispatch to first token, per replica.",
            LATENCY_BUCKETS, label="replica",
        )
        self.registry.register(
            _HistogramCollector((self.queue_wait, self.ttft, self.e2e, self.replica_ttft))
        )
        self._state = _StateCollector(scheduler, self.ledger, clock)
        self.registry.register(self._state)

    def cap_tenants(self, max_tenants: int) -> None:
        """Give the first ``max_tenants`` configured tenants a label of their own (see
        ``TenantLabels``)."""
        self._state.tenant_label = TenantLabels(self._state.scheduler, max_tenants)

    def refused(self, cls: str, tenant: str, reason: str) -> None:
        """A request refused before it reached the scheduler."""
        self.ledger[(cls, tenant, "rejected", reason)] += 1

    def ended(self, cls: str, tenant: str, outcome: str, reason: str) -> None:
        """A request that ended before it reached the scheduler otherwise than refused (its
        client left while sending it: ``cancelled``, ``client_disconnected``)."""
        self.ledger[(cls, tenant, outcome, reason)] += 1

    def observe(self, req: Request) -> None:
        """A request reached its terminal state (driver hook)."""
        cls = req.service_class
        if req.dispatched_at is not None:
            self.queue_wait.observe(cls, req.dispatched_at - req.arrival)
        if req.first_token_at is not None:
            self.ttft.observe(cls, req.first_token_at - req.arrival)
            if req.replica is not None and req.dispatched_at is not None:
                self.replica_ttft.observe(req.replica, req.first_token_at - req.dispatched_at)
            if req.finished_at is not None and req.state is State.COMPLETED:
                self.e2e.observe(cls, req.finished_at - req.arrival)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class BatchingCollector:
    """The embeddings batchers (``runtime/batches.py``): each replica's window now, its batches
    by release reason and by size, and the window controller's decisions."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner

    def collect(self) -> Iterator[Metric]:
        r = self.runner
        st = r.stats
        window = GaugeMetricFamily("qosgate_embeddings_batch_window_seconds",
                                   "The batch window in force at a replica.", labels=["replica"])
        pending = GaugeMetricFamily("qosgate_embeddings_batch_pending",
                                    "Embeddings requests waiting in a batch window.",
                                    labels=["replica"])
        for name, b in r.batchers.items():
            window.add_metric([name], b.window_s)
            pending.add_metric([name], len(b))
        yield window
        yield pending
        released = CounterMetricFamily(
            "qosgate_embeddings_batches",
            "Batches released, by reason (size, tokens, urgent, full, window).",
            labels=["replica", "reason"])
        for (name, why), n in sorted(st.released.items()):
            released.add_metric([name, why], n)
        yield released
        sizes = HistogramMetricFamily("qosgate_embeddings_batch_size",
                                      "Requests per released batch.", labels=["replica"])
        for name, counts in sorted(st.sizes.items()):
            acc = 0
            buckets: list[tuple[str, float]] = []
            for bound, c in zip((*SIZE_BUCKETS, float("inf")), counts, strict=True):
                acc += c
                buckets.append((floatToGoString(bound), acc))  # type: ignore[no-untyped-call]
            sizes.add_metric([name], buckets, st.size_sum.get(name, 0))
        yield sizes
        decisions = CounterMetricFamily(
            "qosgate_embeddings_window_decisions",
            "The adaptive window's evaluations: grow, shrink or hold.",
            labels=["replica", "decision"])
        for (name, dec), n in sorted(st.decisions.items()):
            decisions.add_metric([name, dec], n)
        yield decisions
