"""Prometheus metrics (``GET /metrics``), all prefixed ``qosgate_``.

Counts come from one source of truth: a custom collector reads the core's ``outcomes`` ledger (plus
the gateway's own ledger of requests refused before they reached the scheduler: bad JSON, bad key,
unknown model, ...) at scrape time, so ``qosgate_requests_total`` equals the outcomes exactly.

Every family -- name, type, unit, labels and help text -- is declared once, in
``metric_names.py``; this module builds its families from there (``docs/`` lists them for
operators).

Timeouts are outcomes: ``qosgate_requests_total{outcome="timed_out", reason=...}`` with reason
``queue_timeout``, ``first_byte_timeout``, ``idle_timeout`` or ``total_timeout``.
"""

from __future__ import annotations

import asyncio
import math
import time
from bisect import bisect_left
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from qosgate import metric_names as mn
from qosgate.config import QosConfig
from qosgate.core import Request, Scheduler, State
from qosgate.core.snapshot import Snapshot
from qosgate.runtime.batches.feeder import Feeder
from qosgate.runtime.batches.records import BATCH_STATUSES
from qosgate.runtime.batching import SIZE_BUCKETS, BatchingEngine

LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0
)
# time per output token: engines decode at 5-200 ms a token
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
                2.5)

# the gateway's own ledger, same key as the core's: (class, tenant, outcome, reason)
Ledger = Counter[tuple[str, str, str, str]]


class _HistogramCollector:
    def __init__(self, histograms: tuple[_Histogram, ...]) -> None:
        self.histograms = histograms

    def collect(self) -> Iterator[Metric]:
        for h in self.histograms:
            yield h.collect()


OTHER_TENANT = "other"
OTHER_MODEL = "other"


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


def starvation_waits(cfg: QosConfig) -> dict[str, float]:
    """Per class, the queue wait past which a request is starving: aging lifts it one level per
    ``aging_after_s`` of the level it waits in, up to the ``aging.ceiling`` class; once there (or
    where aging stops) it has that class's ``aging_after_s`` more (its TTFT budget if it has
    none). Defaults: realtime 1 s, api 10 s, batch 40 s, offline 100 s."""
    by_level = {c.level: c for c in cfg.classes}
    ceiling = cfg.class_named(cfg.aging.ceiling).level
    out: dict[str, float] = {}
    for c in cfg.classes:
        t, level = 0.0, c.level
        while cfg.aging.enabled and level > ceiling:
            after = by_level[level].aging_after_s
            if after is None:
                break
            t += after
            level -= 1
        at = by_level[level]
        out[c.name] = t + (at.aging_after_s if at.aging_after_s is not None
                           else at.ttft_budget_ms / 1000.0)
    return out


def tenant_weights(cfg: QosConfig, label: TenantLabels) -> dict[str, float]:
    """The configured weight per ``tenant`` label (``other`` sums the tenants folded into it);
    the default tenant (open mode) weighs 1."""
    out: dict[str, float] = {}
    for t in cfg.tenants:
        name = label(t.name)
        out[name] = out.get(name, 0.0) + t.weight
    out.setdefault(cfg.default_tenant, 1.0)
    return out


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
        cfg = scheduler.cfg
        self.budgets = {c.name: c.ttft_budget_ms / 1000.0 for c in cfg.classes}
        self.starvation = starvation_waits(cfg)
        self.weights = tenant_weights(cfg, self.tenant_label)

    def relabel(self, label: TenantLabels) -> None:
        self.tenant_label = label
        self.weights = tenant_weights(self.scheduler.cfg, label)

    def _usage(self, snap: Snapshot) -> Iterator[Metric]:
        """Each tenant's use of each model, in tokens and in the charged unit, and each
        weighted model's weight. A model label is one the config or a replica names (else
        ``other``), so a client cannot add series by inventing model names."""
        known = {m.name for m in self.scheduler.cfg.models}
        for r in snap.replicas:
            known.update(r.models)
        label = self.tenant_label
        tokens: dict[tuple[str, str], list[int]] = {}
        charged: dict[tuple[str, str], float] = {}
        for u in snap.usage:
            model = u.model if u.model in known else ("none" if not u.model else OTHER_MODEL)
            key = (label(u.tenant), model)
            acc = tokens.setdefault(key, [0, 0])
            acc[0] += u.prompt_tokens
            acc[1] += u.output_tokens
            charged[key] = charged.get(key, 0.0) + u.charged
        fam = mn.TENANT_MODEL_TOKENS.counter()
        for (tenant, model), (prompt, output) in sorted(tokens.items()):
            fam.add_metric([tenant, model, "prompt"], prompt)
            fam.add_metric([tenant, model, "output"], output)
        yield fam
        cost = mn.TENANT_MODEL_CHARGED.counter()
        for (tenant, model), v in sorted(charged.items()):
            cost.add_metric([tenant, model], v)
        yield cost
        weight = mn.MODEL_WEIGHT.gauge()
        for model, w in snap.model_weights.items():
            weight.add_metric([model, "prompt"], float(w["prompt"]))
            weight.add_metric([model, "output"], float(w["output"]))
        yield weight

    def collect(self) -> Iterator[Metric]:
        sched = self.scheduler
        total = mn.REQUESTS.counter()
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

        now = self.clock()
        # tenant rows from the per-tenant counts: a scrape does not walk the queued requests
        snap = sched.snapshot(now, tenants=True, tenant_waits=False)
        depth = mn.QUEUE_DEPTH.gauge()
        oldest = mn.QUEUE_OLDEST.gauge()
        inflight = mn.INFLIGHT.gauge()
        for c in snap.classes:
            depth.add_metric([c.name], c.queued)
            oldest.add_metric([c.name], c.oldest_wait_s)
            inflight.add_metric([c.name], c.inflight)
        yield depth
        yield oldest
        yield inflight
        budget = mn.CLASS_TTFT_BUDGET.gauge()
        for name, v in self.budgets.items():
            budget.add_metric([name], v)
        yield budget
        starving = mn.CLASS_STARVATION.gauge()
        for name, v in self.starvation.items():
            starving.add_metric([name], v)
        yield starving
        per_tenant: dict[str, list[int]] = {}
        for row in snap.tenants:
            acc = per_tenant.setdefault(label(row.tenant), [0, 0])
            acc[0] += row.queued
            acc[1] += row.inflight
        tq = mn.TENANT_QUEUED.gauge()
        ti = mn.TENANT_INFLIGHT.gauge()
        for name, (q, i) in per_tenant.items():
            tq.add_metric([name], q)
            ti.add_metric([name], i)
        yield tq
        yield ti
        weight = mn.TENANT_WEIGHT.gauge()
        for name, w in self.weights.items():
            weight.add_metric([name], w)
        yield weight
        yield from self._usage(snap)
        fair = sched.cfg.fairness
        cost = mn.FAIRNESS_TOKEN_COST.gauge()
        cost.add_metric(["prompt"], fair.prompt_weight)
        cost.add_metric(["output"], fair.output_weight)
        yield cost
        rin = mn.REPLICA_INFLIGHT.gauge()
        cap = mn.REPLICA_CAPACITY.gauge()
        up = mn.REPLICA_UP.gauge()
        eligible = mn.REPLICA_ELIGIBLE.gauge()
        breaker = mn.REPLICA_BREAKER.gauge()
        cooling = mn.REPLICA_COOLING.gauge()
        age = mn.REPLICA_SIGNALS_AGE.gauge()
        running = mn.ENGINE_RUNNING.gauge()
        waiting = mn.ENGINE_WAITING.gauge()
        kv = mn.ENGINE_KV.gauge()
        itl = mn.ENGINE_ITL.gauge()
        held = mn.OTHERS_HELD.gauge()
        guard = mn.TPOT_GUARD.gauge()
        ejections = mn.REPLICA_EJECTIONS.counter()
        for r in snap.replicas:
            rin.add_metric([r.name], r.inflight)
            cap.add_metric([r.name], r.window)
            up.add_metric([r.name], 1.0 if r.up else 0.0)
            eligible.add_metric([r.name], 1.0 if r.eligible else 0.0)
            breaker.add_metric([r.name], 1.0 if r.breaker == "open" else 0.0)
            cooling.add_metric([r.name], r.cooling_s)
            sig = r.signals
            if sig is not None:
                age.add_metric([r.name], max(0.0, now - sig.at))
                if sig.running is not None:
                    running.add_metric([r.name], sig.running)
                if sig.waiting is not None:
                    waiting.add_metric([r.name], sig.waiting)
                if sig.kv_usage is not None:
                    kv.add_metric([r.name], sig.kv_usage)
            if r.engine_itl_s is not None:
                itl.add_metric([r.name], r.engine_itl_s)
            held.add_metric([r.name], 1.0 if r.others_held else 0.0)
            if r.tpot_guard_s is not None:
                guard.add_metric([r.name], r.tpot_guard_s)
            ejections.add_metric([r.name], r.ejections)
        yield from (rin, cap, up, eligible, breaker, cooling, age, running, waiting, kv, itl,
                    held, guard, ejections)
        fails = mn.ATTEMPT_FAILURES.counter()
        for cls, rep, reason, n in snap.attempt_failures:
            fails.add_metric([cls, rep, reason], n)
        yield fails
        retries = mn.RETRIES.counter()
        for cls, rep, reason, n in snap.retries:
            retries.add_metric([cls, rep, reason], n)
        yield retries
        pre = mn.PREEMPTIONS.counter()
        for cls, n in snap.preemptions:
            pre.add_metric([cls], n)
        yield pre
        evicted = mn.EVICTIONS.counter()
        for cls, n in snap.evictions:
            evicted.add_metric([cls], n)
        yield evicted
        moved = mn.MOVES.counter()
        for cls, reason, n in snap.moves:
            moved.add_metric([cls, reason], n)
        yield moved
        resumed = mn.RESUMES.counter()
        for cls, n in snap.resumes:
            resumed.add_metric([cls], n)
        yield resumed
        resent = mn.RESENT_TOKENS.counter()
        cached = mn.RESENT_CACHED.counter()
        for cls, n, hit in snap.resent:
            resent.add_metric([cls], n)
            cached.add_metric([cls], hit)
        yield resent
        yield cached
        over = mn.REPLICA_OVERTAKES.counter()
        for name, n in snap.overtakes:
            over.add_metric([name], n)
        yield over
        seen = mn.ADMITTED_SEEN.counter()
        factor = mn.ADMISSION_FACTOR.gauge()
        for cls, n, met, k in snap.calibration:
            seen.add_metric([cls, "true"], met)
            seen.add_metric([cls, "false"], n - met)
            factor.add_metric([cls], k)
        yield seen
        yield factor
        booked = mn.RETRY_BOOKINGS.counter()
        for outcome, n in zip(("made", "kept", "lapsed"), snap.bookings, strict=True):
            booked.add_metric([outcome], n)
        yield booked


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

    @classmethod
    def of(cls, family: mn.Family, bounds: tuple[float, ...]) -> _Histogram:
        """The histogram of a registered family (one label)."""
        assert family.kind == "histogram" and len(family.labels) == 1, family.name
        return cls(family.name, family.help, bounds, family.labels[0])

    def observe(self, cls: str, value: float) -> None:
        child = self.by_class.get(cls)
        if child is None:
            child = self.by_class[cls] = ([0] * (len(self.bounds) + 1), [0.0, time.time()])
        child[0][bisect_left(self.bounds, value)] += 1
        child[1][0] += value

    def collect(self) -> Metric:
        fam = HistogramMetricFamily(self.name, self.doc, labels=[self.label])
        name = self.name + "_created"
        label = self.label
        for cls, (counts, (total, created)) in self.by_class.items():
            acc = 0
            buckets = []
            for le, n in zip(self.les, counts, strict=True):
                acc += n
                buckets.append((le, float(acc)))
            fam.add_metric([cls], buckets, total)
            fam.add_sample(name, {label: cls}, created)
        return fam


class _SelfCollector:
    """The gateway's own cost, read at scrape time only (nothing on a request's path): CPU
    seconds of the process, how long the previous render took, and the event loop's lag — a
    callback queued at each scrape records how long it waited for the loop."""

    def __init__(self) -> None:
        self.render_s: float | None = None
        self.loop_lag_s: float | None = None

    def probe_loop(self) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # rendered outside the loop (tests, tools): nothing to measure
            return
        loop.call_soon(self._lagged, time.perf_counter())

    def _lagged(self, queued: float) -> None:
        self.loop_lag_s = time.perf_counter() - queued

    def collect(self) -> Iterator[Metric]:
        cpu = mn.CPU.counter()
        cpu.add_metric([], time.process_time())
        yield cpu
        lag = mn.LOOP_LAG.gauge()
        if self.loop_lag_s is not None:
            lag.add_metric([], self.loop_lag_s)
        yield lag
        render = mn.RENDER.gauge()
        if self.render_s is not None:
            render.add_metric([], self.render_s)
        yield render


class _RequestCounters:
    """Counters kept by ``GatewayMetrics.observe`` (and ``prompt_cache``), rendered at scrape
    time: per class ``[met, missed]`` SLO verdicts, per tenant label ``[prompt, output]`` tokens,
    per replica ``[offered, cached]`` prompt tokens (plain lists in dicts: one lookup each on
    the request's path); and, off that path, the utility calls passed through and the config
    reloads."""

    def __init__(self) -> None:
        self.slo: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.prompt_cache: dict[str, list[int]] = {}
        self.passed: Counter[tuple[str, int]] = Counter()  # (route, status) passed through
        self.reloads: dict[str, int] = {"applied": 0, "refused": 0}  # of the config file

    def collect(self) -> Iterator[Metric]:
        slo = mn.SLO.counter()
        for cls, (met, missed) in self.slo.items():
            slo.add_metric([cls, "met"], met)
            slo.add_metric([cls, "missed"], missed)
        yield slo
        tokens = mn.TENANT_TOKENS.counter()
        for tenant, (prompt, output) in sorted(self.tokens.items()):
            tokens.add_metric([tenant, "prompt"], prompt)
            tokens.add_metric([tenant, "output"], output)
        yield tokens
        cache = mn.REPLICA_PROMPT_TOKENS.counter()
        for replica, (offered, cached) in sorted(self.prompt_cache.items()):
            cache.add_metric([replica, "offered"], offered)
            cache.add_metric([replica, "cached"], cached)
        yield cache
        passed = mn.PASSED_THROUGH.counter()
        for (route, status), n in sorted(self.passed.items()):
            passed.add_metric([route, str(status)], n)
        yield passed
        reloads = mn.CONFIG_RELOADS.counter()
        for outcome, n in self.reloads.items():
            reloads.add_metric([outcome], n)
        yield reloads


class GatewayMetrics:
    def __init__(
        self,
        scheduler: Scheduler,
        clock: Callable[[], float],
    ) -> None:
        self.ledger: Ledger = Counter()
        self.registry = CollectorRegistry(auto_describe=False)
        self.queue_wait = _Histogram.of(mn.QUEUE_WAIT, LATENCY_BUCKETS)
        self.ttft = _Histogram.of(mn.TTFT, LATENCY_BUCKETS)
        self.e2e = _Histogram.of(mn.E2E, LATENCY_BUCKETS)
        self.tpot = _Histogram.of(mn.TPOT, TPOT_BUCKETS)
        self.replica_ttft = _Histogram.of(mn.REPLICA_TTFT, LATENCY_BUCKETS)
        self.registry.register(_HistogramCollector(
            (self.queue_wait, self.ttft, self.e2e, self.tpot, self.replica_ttft)))
        self._state = _StateCollector(scheduler, self.ledger, clock)
        self.registry.register(self._state)
        self.counters = _RequestCounters()
        self.registry.register(self.counters)
        self._self = _SelfCollector()
        self.registry.register(self._self)
        # per class: (TTFT budget, TPOT budget or inf when the class sets none)
        self._budgets: dict[str, tuple[float, float]] = {}
        for c in scheduler.cfg.classes:
            tpot_ms = c.tpot_budget_ms
            self._budgets[c.name] = (c.ttft_budget_ms / 1000.0,
                                     math.inf if tpot_ms is None else tpot_ms / 1000.0)

    def cap_tenants(self, max_tenants: int) -> None:
        """Give the first ``max_tenants`` configured tenants a label of their own (see
        ``TenantLabels``)."""
        self._state.relabel(TenantLabels(self._state.scheduler, max_tenants))

    def refused(self, cls: str, tenant: str, reason: str) -> None:
        """A request refused before it reached the scheduler."""
        self.ledger[(cls, tenant, "rejected", reason)] += 1

    def passed(self, route: str, status: int) -> None:
        """A utility call passed through to an engine (``server/passthrough.py``)."""
        self.counters.passed[(route, status)] += 1

    def ended(self, cls: str, tenant: str, outcome: str, reason: str) -> None:
        """A request that ended before it reached the scheduler otherwise than refused (its
        client left while sending it: ``cancelled``, ``client_disconnected``)."""
        self.ledger[(cls, tenant, outcome, reason)] += 1

    def observe(self, req: Request) -> None:
        """A request reached its terminal state (driver hook). Called once per request: a few
        dict and list updates, no clock read (``bench/metrics_observe.py`` times it)."""
        cls = req.service_class
        if req.dispatched_at is not None:
            self.queue_wait.observe(cls, req.dispatched_at - req.arrival)
        first = req.first_token_at
        if first is None:
            return
        ttft = first - req.arrival
        self.ttft.observe(cls, ttft)
        if req.replica is not None and req.dispatched_at is not None:
            self.replica_ttft.observe(req.replica, first - req.dispatched_at)
        tenant = req.tenant
        if tenant not in self._state.tenant_label.known:
            tenant = OTHER_TENANT
        acc = self.counters.tokens.get(tenant)
        if acc is None:
            acc = self.counters.tokens[tenant] = [0, 0]
        acc[0] += req.prompt_tokens
        acc[1] += req.output_tokens
        if req.finished_at is not None and req.state is State.COMPLETED:
            self.e2e.observe(cls, req.finished_at - req.arrival)
            tpot = req.tpot
            if tpot is not None:
                self.tpot.observe(cls, tpot)
            else:
                tpot = 0.0  # one token: nothing to judge
            budget = self._budgets.get(cls)
            if budget is not None:
                verdict = self.counters.slo.get(cls)
                if verdict is None:
                    verdict = self.counters.slo[cls] = [0, 0]
                verdict[0 if ttft <= budget[0] and tpot <= budget[1] else 1] += 1

    def prompt_cache(self, replica: str, offered: int, cached: int) -> None:
        """An engine reported its prefix cache for a completed call (driver hook): ``offered``
        prompt tokens, ``cached`` of them taken from its cache."""
        acc = self.counters.prompt_cache.get(replica)
        if acc is None:
            acc = self.counters.prompt_cache[replica] = [0, 0]
        acc[0] += offered
        acc[1] += cached

    def render(self) -> bytes:
        t0 = time.perf_counter()
        out = generate_latest(self.registry)
        self._self.render_s = time.perf_counter() - t0
        self._self.probe_loop()
        return out


class BatchingCollector:
    """The embeddings batchers (``runtime/batching.py``): each replica's linger now, its
    batches by release reason and by size, and the linger controller's decisions."""

    def __init__(self, engines: list[BatchingEngine]) -> None:
        self.engines = engines

    def collect(self) -> Iterator[Metric]:
        linger = mn.EMB_WINDOW.gauge()
        pending = mn.EMB_PENDING.gauge()
        for b in self.engines:
            linger.add_metric([b.name], b.batcher.linger_s)
            pending.add_metric([b.name], len(b.batcher))
        yield linger
        yield pending
        by_name = sorted(self.engines, key=lambda b: b.name)
        released = mn.EMB_BATCHES.counter()
        for b in by_name:
            for why, n in sorted(b.stats.released.items()):
                released.add_metric([b.name, why], n)
        yield released
        sizes = mn.EMB_SIZE.histogram()
        for b in by_name:
            st = b.stats
            if not st.batches:
                continue
            acc = 0
            buckets: list[tuple[str, float]] = []
            for bound, c in zip((*SIZE_BUCKETS, float("inf")), st.sizes, strict=True):
                acc += c
                buckets.append((floatToGoString(bound), acc))  # type: ignore[no-untyped-call]
            sizes.add_metric([b.name], buckets, st.size_sum)
        yield sizes
        decisions = mn.EMB_DECISIONS.counter()
        for b in by_name:
            for dec, n in sorted(b.stats.decisions.items()):
                decisions.add_metric([b.name, dec], n)
        yield decisions


class BatchJobsCollector:
    """Batch jobs: the store's jobs by status (read by the feeder at each sweep, not here: a
    scrape must not wait on the disk) and this instance's lines by outcome and in flight."""

    def __init__(self, feeder: Feeder) -> None:
        self.feeder = feeder

    def collect(self) -> Iterator[Metric]:
        st = self.feeder.snapshot()
        jobs = mn.BATCH_JOBS.gauge()
        for status in BATCH_STATUSES:
            jobs.add_metric([status], st.stored.get(f"jobs_{status}", 0))
        yield jobs
        lines = mn.BATCH_LINES.counter()
        for outcome, n in st.lines.items():
            lines.add_metric([outcome], n)
        yield lines
        in_flight = mn.BATCH_IN_FLIGHT.gauge()
        in_flight.add_metric([], sum(st.in_flight.values()))
        yield in_flight
        spare = mn.BATCH_SPARE.gauge()
        spare.add_metric([], st.spare)
        yield spare
