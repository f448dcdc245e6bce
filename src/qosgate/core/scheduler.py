"""The scheduler: events in, decisions out. Sans-I/O: the clock is always passed in.

One object drives the whole life of a request — admission, queueing, aging, timeouts, dispatch to a
replica with a free slot, preemption, and the single terminal outcome — so the gateway (asyncio,
real time) and the simulator (virtual time) run exactly the same code. Every handler first fires
the timers that are due at ``now`` and ends by filling free slots (work-conserving: nothing waits
while a slot is free).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from qosgate.config import QosConfig, ServiceClass, TenantLimits
from qosgate.core.classifier import Classifier, QosInputs
from qosgate.core.decisions import Decision, Dispatch, Finished, Preempt
from qosgate.core.ledger import Limiter, LocalLedger, TenantLedger
from qosgate.core.limits import EngineLimit
from qosgate.core.policies import Policy, build_policy
from qosgate.core.replica import (
    BUDGET_OPEN,
    AlwaysClosed,
    Breaker,
    FixedLimit,
    Limit,
    OutlierDetector,
    Replica,
    Router,
    build_router,
)
from qosgate.core.request import (
    CANCELLED,
    COMPLETED,
    DISPATCHED,
    FAILED,
    LENT_PREEMPTIBLE,
    LENT_STREAMING,
    NOT_LENT,
    PREEMPTED,
    QUEUED,
    REJECTED,
    RUNNING,
    TIMED_OUT,
    Request,
    State,
)
from qosgate.core.signals import LoadSignals
from qosgate.core.snapshot import ClassView, ReplicaView, Snapshot, TenantView
from qosgate.core.tpot_guard import build_guard


@dataclass(slots=True)
class ReplicaSpec:
    name: str
    capacity: int
    pausable: bool = False  # the engine can pause a running sequence and resume it (in-process)
    models: tuple[str, ...] = ()  # model ids it serves; empty = any
    up: bool = True  # until its first health probe says otherwise
    # "adaptive" or "fixed" (capacity is then the window's ceiling or the window); None: the
    # config's mode, but fixed for a pausable engine
    window: str | None = None
    # the engine runs its waiting queue in the order it is sent (``Request.order``): a request
    # may then overtake this gateway's unstarted work there (``fleet.window.overtake``)
    ordered: bool = False


_HOLD_MAX = 32  # requests set aside in one fill because no replica of theirs may take them
_RATE_EVERY_S = 0.05  # how long admission reuses a reading of the completion rate
_PREDICT_EVERY_S = 0.05  # ... and a predicted wait against a queue-timeout promise


class DecayingRate:
    """Events per second, exponentially decayed with time constant ``tau`` (seconds).

    Until ``min_events`` have been seen it knows nothing (0). Early on, the decayed sum has only
    covered ``elapsed`` seconds, not the whole window, so it is divided by the part of the window
    it has seen (1 - e^(-elapsed/tau)); without that, a busy gateway would under-read its own
    throughput for the first ``tau`` seconds and refuse feasible deadlines.
    """

    __slots__ = ("_count", "_first", "_stamp", "_value", "min_events", "tau")

    def __init__(self, tau: float = 10.0, min_events: int = 5) -> None:
        self.tau = tau
        self.min_events = min_events
        self._value = 0.0
        self._stamp = 0.0
        self._first: float | None = None
        self._count = 0

    def add(self, now: float, amount: float = 1.0) -> None:
        """One event (of ``amount``: a rate of cost rather than of events)."""
        if self._first is None:
            self._first = now
        self._value = self._decayed(now) + amount / self.tau
        self._stamp = now
        self._count += 1

    def _decayed(self, now: float) -> float:
        return self._value * math.exp(-max(0.0, now - self._stamp) / self.tau)

    def value(self, now: float) -> float:
        if self._count < self.min_events or self._first is None:
            return 0.0
        seen = 1.0 - math.exp(-max(0.0, now - self._first) / self.tau)
        return self._decayed(now) / seen if seen > 1e-9 else 0.0


class Scheduler:
    def __init__(
        self,
        cfg: QosConfig,
        policy: str | None = None,
        replicas: Iterable[ReplicaSpec] = (),
        router: Router | None = None,
        ledger: TenantLedger | None = None,
    ) -> None:
        self.cfg = cfg
        # where each tenant's limiter comes from: this instance's own (default) or a fleet's
        self.ledger: TenantLedger = ledger if ledger is not None else LocalLedger()
        self.policy: Policy = build_policy(cfg, policy)
        self.classifier = Classifier(cfg)
        self.classes: list[ServiceClass] = list(cfg.classes)
        self._level_of = {c.name: c.level for c in self.classes}
        self._ceiling = self._level_of[cfg.aging.ceiling]
        self._wp = cfg.fairness.prompt_weight
        self._wq = cfg.fairness.output_weight
        self._tenant_cfg = {t.name: t for t in cfg.tenants}
        self._strict = [c.strict for c in self.classes]
        self._strict_levels = [c.level for c in self.classes if c.strict]
        self._weighted_levels = [(c.level, c.weight) for c in self.classes if not c.strict]
        # share of each window kept for the classes above a band (replica-level isolation), and
        # whether a class may borrow it while idle (it can give it back: it is preemptible)
        self._reserve_above = [
            sum(c.reserved_share for c in self.classes if c.level < lvl)
            for lvl in range(len(self.classes))
        ]
        self._may_borrow = [c.preemptible for c in self.classes]
        # the largest share of a window a class may not use (kept for the classes above it)
        self._reserve_max = max(
            (f for f, borrow in zip(self._reserve_above, self._may_borrow, strict=True)
             if not borrow), default=0.0)
        # the classes a reserve holds back that may not borrow it: while one of theirs waits,
        # the reserve is lent to no one (see _reserve_allows)
        self._unlent_levels = [
            c.level for c in self.classes if self._reserve_above[c.level] and not c.preemptible]
        # the smallest reserve any queued non-strict request can face (aging stops at the
        # ceiling), for the test that nothing queued may go
        self._reserve_floor = min(
            (self._reserve_above[min(c.level, self._ceiling)] for c in self.classes
             if not c.strict), default=0.0)
        # the prefill budget protects the strict classes' streams: a policy blind to classes
        # (fifo, the baseline) has none to protect
        self._prefill_budget = (
            cfg.fleet.prefill_budget_tokens if self.policy.class_aware else None
        )
        # each strict class's TPOT budget (None for the others), which the TPOT guard and the
        # spreading router protect; the guard holds a replica past the tightest one times its
        # fraction
        self._tpot_budget_s = [
            c.tpot_budget_ms / 1000.0 if c.strict and c.tpot_budget_ms else None
            for c in self.classes
        ]
        strict_tpot_s = {lvl: b for lvl, b in enumerate(self._tpot_budget_s) if b is not None}
        self._guard_mode = (
            cfg.fleet.tpot_guard if strict_tpot_s and self.policy.class_aware else None
        )
        self._guard_budget_s = min(strict_tpot_s.values(), default=0.0)
        self._hold_others = self._prefill_budget is not None or self._guard_mode is not None
        # a strict prompt waiting on a replica holds the other classes' requests from it
        self._prompt_hold = cfg.fleet.strict_prompt_hold and self.policy.class_aware
        # replicas whose prefill budget this fill closed to the classes below a held prompt
        self._budget_closed: list[Replica] = []
        # whether a rule may keep free room from the queue (the reserve, the prefill budget,
        # the TPOT guard): only then can a fill find nothing to dispatch beside free slots
        self._may_stall = self._hold_others or self._prompt_hold or any(self._reserve_above)
        self._rate_at = (-math.inf, 0.0)
        # queued requests per class and tenant: with fairness between tenants inside a class,
        # a light tenant's request waits behind its own share of the class's queue, not all of it
        self._tenant_queued: list[dict[str, int]] = [{} for _ in self.classes]
        self._tenant_fair = self.policy.name == "qos"
        self._predicted: list[tuple[float, float | None] | None] = [None] * len(self.classes)
        self._admission_wait = [
            c.admission_wait_s if c.admission_wait_s is not None else c.queue_timeout_s
            for c in self.classes
        ]

        self.requests: dict[str, Request] = {}  # every live (non-terminal) request
        # queued requests per service class in queueing order (newest last: the displacement victim)
        self.queued: list[dict[str, Request]] = [{} for _ in self.classes]
        self.queued_total = 0
        self.replicas: dict[str, Replica] = {}
        self.router: Router = (
            router if router is not None else build_router(cfg.fleet.router, strict_tpot_s))
        # replicas that may take work now; free_slots counts only their room
        self._usable: list[Replica] = []
        self._usable_names: set[str] = set()
        self._any_model = True  # every usable replica serves every model: no model filter
        self._one_pool = True  # every usable replica serves the same models: classes share slots
        # models some up replica serves (None: one serves any model, or there is no replica)
        self._up_models: frozenset[str] | None = None
        self._next_change = math.inf  # when a cooling or an ejection ends
        self.free_slots = 0
        self._retrying = 0  # live requests on a retry (for the retry budget)
        self._seed = cfg.fleet.seed
        # (class, replica, reason) -> count of attempts that failed before the first byte, and of
        # those that were retried; preemptions per class
        self.attempt_failures: Counter[tuple[str, str, str]] = Counter()
        self.retries: Counter[tuple[str, str, str]] = Counter()
        self.preemptions: Counter[str] = Counter()
        # dispatches past a full window, to overtake unstarted work in an ordered engine
        self.overtakes: Counter[str] = Counter()
        self._overtake = cfg.fleet.window.overtake
        self._preemptible: dict[str, Request] = {}
        self._timers: list[tuple[float, int, Request, int]] = []
        self._aging = cfg.aging.enabled and self.policy.class_aware
        self._timer_seq = 0
        self._limiters: dict[str, Limiter] = {}
        self._out_est = [256.0] * len(self.classes)
        self.completions = DecayingRate()
        # first dispatches per class: the service a backlogged class actually gets, after the
        # strict classes, the other shares and aging took theirs (what admission predicts from)
        self._served = [DecayingRate() for _ in self.classes]
        # ... and their cost (fair-share units), for each class's weighted share of the service
        self._served_cost = [DecayingRate() for _ in self.classes]
        self._paused_queued = 0  # queued requests paused on a replica (they resume only there)
        # (class, tenant, outcome, reason) -> count: the ledger both drivers report from
        self.outcomes: Counter[tuple[str, str, str, str]] = Counter()
        for spec in replicas:
            self.add_replica(spec)

    # ---------------------------------------------------------------- building requests
    def make_request(
        self,
        rid: str,
        inputs: QosInputs,
        now: float,
        prompt_tokens: int,
        max_tokens: int | None,
        model: str = "",
        *,
        context: int | None = None,
    ) -> Request:
        """Classify and build a request; raises QosInputError for unusable QoS inputs.

        ``max_tokens`` is the output cap the client asked for; None: none, so the engine runs
        to its own end, within its ``context`` (prompt and output, as the engine reports it)
        unless a configured ceiling applies. Either way admission charges the class's learned
        output length within that bound, and the real usage is settled at completion."""
        c = self.classifier.classify(inputs)
        ceiling = self._output_ceiling(c.service_class, c.tenant)
        if max_tokens is None:
            most = self.cfg.admission.max_output_tokens
            if ceiling is not None:
                max_tokens = ceiling
            elif context is not None:
                max_tokens = max(1, min(context - prompt_tokens, most))
            else:
                max_tokens = most
        est = min(float(max_tokens), self._out_est[self._level_of[c.service_class]])
        req = Request(
            rid,
            c.tenant,
            c.service_class,
            c.level,
            now,
            now + c.budget_s,
            prompt_tokens,
            max_tokens,
            requested_class=c.requested_class,
            est_output_tokens=int(est),
            model=model,
        )
        req.cost = self._wp * prompt_tokens + self._wq * est
        req.ceiling = ceiling
        return req

    def _output_ceiling(self, service_class: str, tenant: str) -> int | None:
        """The smaller of the class's and the tenant's configured output ceilings."""
        caps = [self.classes[self._level_of[service_class]].max_output_tokens]
        t = self._tenant_cfg.get(tenant)
        if t is not None:
            caps.append(t.limits.max_output_tokens)
        return min((v for v in caps if v is not None), default=None)

    # ---------------------------------------------------------------- replicas
    def add_replica(self, spec: ReplicaSpec, limit: Limit | None = None) -> None:
        if spec.name in self.replicas:
            raise ValueError(f"replica {spec.name!r} exists")
        o = self.cfg.fleet.outlier
        breaker: Breaker = (
            OutlierDetector(
                o.consecutive_failures, o.base_ejection_s, o.max_ejection_s, o.jitter,
                seed=self._seed + len(self.replicas),
            )
            if o.enabled
            else AlwaysClosed()
        )
        if limit is None:
            w = self.cfg.fleet.window
            # a pausable (in-process) engine is scheduled here token by token: its window is
            # its batch unless asked otherwise
            mode = spec.window or ("fixed" if spec.pausable else w.mode)
            if mode == "adaptive":
                limit = EngineLimit(
                    min(spec.capacity, w.initial), min_limit=min(w.min, spec.capacity),
                    max_limit=spec.capacity, kv_target=w.kv_target,
                    waiting_allowance=w.waiting_allowance, shrink=w.shrink,
                    grow_frac=w.grow_frac, settle_s=w.settle_s, cooldown_s=w.cooldown_s,
                    latency_target_s=w.latency_target_s, stale_s=w.stale_s,
                )
            else:
                limit = FixedLimit(spec.capacity)
        guard_mode = self._guard_mode
        self.replicas[spec.name] = Replica(
            spec.name,
            limit,
            models=spec.models,
            pausable=spec.pausable,
            breaker=breaker,
            up=spec.up,
            guard=None if guard_mode is None else build_guard(guard_mode),
            ordered=spec.ordered,
        )
        self._refresh(-math.inf)

    def set_capacity(self, name: str, capacity: int, now: float) -> list[Decision]:
        """Set a fixed window (tests, operators); in-flight work is never cut."""
        rep = self.replicas[name]
        if not isinstance(rep.limit, FixedLimit):
            raise TypeError(f"replica {name!r} has an adaptive window")
        rep.limit.set(capacity)
        out: list[Decision] = []
        self._advance(now, out)
        self._refresh(now)
        self._fill(now, out)
        return out

    def observe(
        self,
        name: str,
        now: float,
        *,
        up: bool | None = None,
        models: Sequence[str] | None = None,
        signals: LoadSignals | None = None,
    ) -> list[Decision]:
        """What a health probe or a metrics scrape found out about a replica."""
        out: list[Decision] = []
        self._advance(now, out)
        rep = self.replicas.get(name)
        if rep is None:
            return out
        if up is not None:
            rep.up = up
        if models is not None:
            rep.models = frozenset(models)
        if signals is not None:
            rep.signals = signals
            rep.limit.on_signals(now, signals, self._busy(rep))
            self._watch_itl(rep, signals)
            rep.engine_share = signals.share(len(rep.inflight))
        self._refresh(now)
        self._fill(now, out)
        return out

    def _watch_itl(self, rep: Replica, signals: LoadSignals) -> None:
        """The engine's recent time per output token, and the TPOT guard on it: hold the other
        classes off a replica whose streams slow past the guard while it serves a strict class
        (their prefill and their decodes both lengthen its steps), until it is well under."""
        total, tokens = signals.itl_seconds_total, signals.itl_tokens_total
        if total is None or tokens is None:
            return
        seen, rep.itl_seen = rep.itl_seen, (total, tokens)
        if seen is None or tokens <= seen[1]:
            return  # nothing decoded since (or the engine restarted): no new reading
        rep.itl_s = itl = (total - seen[0]) / (tokens - seen[1])
        guard = self._guard_s(rep)
        if guard is not None:
            rep.others_held = itl > (0.75 * guard if rep.others_held else guard)

    def _guard_s(self, rep: Replica) -> float | None:
        """The inter-token latency past which the TPOT guard holds ``rep`` (None: no guard)."""
        g = rep.guard
        return None if g is None else g.fraction * self._guard_budget_s

    def _busy(self, rep: Replica) -> int:
        """What a window counts as in use: the requests in flight and the free room kept for
        the classes above (the reserved share), which the queue may not fill. Without the
        latter a window of 20 or more never counted as full under api traffic and never grew."""
        reserved = int(self._reserve_max * rep.limit.limit)
        return len(rep.inflight) + (min(reserved, rep.free) if reserved else 0)

    def _refresh(self, now: float) -> None:
        """Recount which replicas may take work (and their room) after a change of health,
        cooling, ejection or window."""
        usable = [r for r in self.replicas.values() if r.eligible(now)]
        self._usable = usable
        self._usable_names = {r.name for r in usable}
        self._any_model = all(not r.models for r in usable)
        self._one_pool = len({r.models for r in usable}) <= 1
        up = [r for r in self.replicas.values() if r.up]
        if not self.replicas or any(not r.models for r in up):
            self._up_models = None
        else:
            self._up_models = frozenset(m for r in up for m in r.models)
        self.free_slots = sum(r.free for r in usable)
        nxt = math.inf
        for r in self.replicas.values():
            t = r.next_change()
            if t is not None and now < t < nxt:
                nxt = t
        self._next_change = nxt

    def _sampled(self, rep: Replica, now: float, latency: float, dropped: bool) -> None:
        """Tell a replica's window how an attempt went; its room changes with it."""
        before = rep.free
        rep.limit.on_sample(now, latency, len(rep.inflight), dropped)
        if rep.name in self._usable_names:
            self.free_slots += rep.free - before

    # ---------------------------------------------------------------- events
    def submit(self, req: Request, now: float) -> list[Decision]:
        out: list[Decision] = []
        timers = self._timers
        if (timers and timers[0][0] <= now) or now >= self._next_change:
            self._advance(now, out)
        limiter = self._limiter(req.tenant, now)
        refusal = self._admission(req, limiter, now, out)
        if refusal is not None:
            reason, retry_after = refusal
            req.retry_after = retry_after
            req.move(REJECTED, reason)
            self._record(req, now, out)
            return out
        tokens = req.prompt_tokens + req.est_output_tokens
        limiter.admit(tokens, req.id)
        req.charged_tpm = tokens
        self.requests[req.id] = req
        self._enqueue(req, now, arm=False)
        if self.free_slots:
            self._fill(now, out)
        elif self.classes[req.level].can_preempt and self.policy.preemptive:
            self._preempt_for(req, now, out)
            self._fill(now, out)
        if self._overtake and not self.free_slots and self.policy.root.n:
            self._overtake_unstarted(now, out)
        if req.state is QUEUED:  # a request dispatched at once needs no timer
            self._arm(req)
        return out

    def first_byte(self, rid: str, now: float, token_at: float | None = None) -> bool:
        """The first byte of ``rid``'s response is about to reach its client: from here on it is
        never retried, nor preempted by abort. False if it may not be sent (the request was
        pulled back or ended meanwhile): the caller then sends nothing. ``token_at``: when the
        engine's first token came, if earlier (a whole answer assembled from a stream reaches
        its client only at the end; its TTFT and the engine's latency are the token's).

        On a pausable engine a request paused after its first byte still delivers the tokens
        of its last step, in order; that is no new first byte and is allowed. A first byte that
        changes a replica's window (the end of a probation) makes ``next_timer`` due at once,
        so the driver's next tick hands the room to the queue."""
        req = self.requests.get(rid)
        if req is None:
            return False
        state = req.state
        if state is RUNNING:
            return True
        if state is DISPATCHED:
            req.move(RUNNING)
            self.policy.started(req)
            first = now if token_at is None else token_at
            if req.first_token_at is None:
                req.first_token_at = first
            if req.avoid is not None:  # a retry that got through: out of the retry budget
                self._retrying -= 1
                req.avoid = None
            rep = self.replicas.get(req.replica or "")
            if rep is not None:
                rep.prefill_tokens -= req.prompt_tokens
                rep.pending -= 1
                if self._strict[req.class_level]:
                    rep.strict_streams += 1
                else:
                    rep.other_prefill_tokens -= req.prompt_tokens
                if rep.strict_streams and (self._prefill_budget is not None
                                           or self._prompt_hold):
                    # prefill budget freed, or the hold for a strict prompt ended: the queue
                    # may use it now
                    self._next_change = now
                if not rep.pausable and self._preemptible.pop(rid, None) is not None:
                    rep.preemptible -= 1
                    if req.lent == LENT_PREEMPTIBLE:  # its slot is on loan until it ends
                        req.lent = LENT_STREAMING
                        rep.loan_streams += 1
                if rep.failing:  # a success ends a run of failures (and a probation)
                    rep.failing = False
                    rep.breaker.on_result(now, True)
                    self._next_change = now  # recount the room at the next tick (now)
                if type(rep.limit) is not FixedLimit:
                    self._sampled(rep, now, first - (req.dispatched_at or first), False)
            return True
        return state is QUEUED and req.replica is not None and req.first_token_at is not None

    def first_token(self, rid: str, now: float) -> list[Decision]:
        """``first_byte`` for drivers with no client (the simulator, tests): the first token is
        the first byte."""
        out: list[Decision] = []
        timers = self._timers
        if (timers and timers[0][0] <= now) or now >= self._next_change:
            self._advance(now, out)
        self.first_byte(rid, now)
        if now >= self._next_change:  # it changed a window: the room goes to the queue
            self._advance(now, out)
            self._fill(now, out)
        return out

    def progress(self, rid: str, tokens: int) -> None:
        """``tokens`` output tokens have reached the client so far: what a cancel or a failure
        mid-stream charges the tenant."""
        req = self.requests.get(rid)
        if req is not None and tokens > req.streamed:
            req.streamed = tokens

    def attempt_failed(
        self,
        rid: str,
        now: float,
        reason: str,
        *,
        retryable: bool = True,
        unreachable: bool = False,
        backpressure: bool = False,
        retry_after: float | None = None,
    ) -> list[Decision]:
        """An engine call failed before the first byte reached the client. The replica learns
        of it (``unreachable``: it is down until a probe says otherwise; ``backpressure``: the
        engine said 429/503, it is cooled for ``retry_after`` and its window told, not counted
        as a fault). The request is re-queued in its place (same deadline) for another replica
        while its attempts and the retry budget allow; else it ends ``failed`` (or
        ``timed_out`` for a timeout reason)."""
        out: list[Decision] = []
        self._advance(now, out)
        req = self.requests.get(rid)
        if req is None or req.state is not DISPATCHED:
            if req is not None and req.state is RUNNING:  # a byte went out: never retried
                return self._end_running(rid, now, FAILED, reason, 0, None)
            self._fill(now, out)
            return out
        rep = self.replicas.get(req.replica or "")
        name = req.replica or ""
        self.attempt_failures[(req.service_class, name, reason)] += 1
        if rep is not None:
            if backpressure:
                wait = retry_after if retry_after is not None else self.cfg.fleet.cooldown_s
                rep.cooled_until = max(rep.cooled_until, now + wait)
                rep.limit.on_sample(now, now - (req.dispatched_at or now), len(rep.inflight), True)
            else:
                rep.failing = True
                rep.breaker.on_result(now, False)
            if unreachable:
                rep.up = False
        self._release_slot(req)
        self._refresh(now)
        req.failures += 1
        # the budget bounds retries that add load; a replica that refused the connection
        # took none, and a request already retrying is counted once
        retry = retryable and req.failures < self.cfg.fleet.retries.max_attempts and (
            req.avoid is not None or unreachable or self._retry_budget_left()
        )
        if not retry:
            state = TIMED_OUT if reason.endswith("timeout") else FAILED
            self.policy.settle(req, -req.cost)  # served nothing
            req.move(state, reason)
            req.retry_after = retry_after
            self._release_tenant(req, 0)
            self._record(req, now, out)
            self._fill(now, out)
            return out
        if req.avoid is None:
            self._retrying += 1
        req.avoid = name
        self.retries[(req.service_class, name, reason)] += 1
        self.policy.settle(req, -req.cost)  # refunded: charged again when re-dispatched
        req.replica = None
        self._enqueue(req, now)
        self._fill(now, out)
        return out

    def engine_refused(self, rid: str, now: float, reason: str) -> list[Decision]:
        """The engine judged the request itself unservable (a 4xx, before any byte reached the
        client): it ends ``rejected``, as a bad request refused by the gateway would. Not the
        replica's fault: its breaker is not told, and nothing is charged."""
        out: list[Decision] = []
        self._advance(now, out)
        req = self.requests.get(rid)
        if req is None or req.state is not DISPATCHED:
            self._fill(now, out)
            return out
        self._release_slot(req)
        self.policy.settle(req, -req.cost)
        req.move(REJECTED, reason)
        self._release_tenant(req, 0)
        self._record(req, now, out)
        self._fill(now, out)
        return out

    def _retry_budget_left(self) -> bool:
        r = self.cfg.fleet.retries
        budget = max(float(r.min_retries), r.budget_percent / 100.0 * len(self.requests))
        return self._retrying < budget

    def timed_out(
        self, rid: str, now: float, reason: str, output_tokens: int = 0
    ) -> list[Decision]:
        """A dispatched request ran past a bound after its first byte (idle between chunks,
        total time): it ends ``timed_out`` with that reason."""
        return self._end_running(rid, now, TIMED_OUT, reason, output_tokens, None)

    def complete(
        self, rid: str, now: float, output_tokens: int, prompt_tokens: int | None = None
    ) -> list[Decision]:
        return self._end_running(
            rid, now, COMPLETED, "completed", output_tokens, prompt_tokens
        )

    def fail(self, rid: str, now: float, reason: str, output_tokens: int = 0) -> list[Decision]:
        req = self.requests.get(rid)
        rep = self.replicas.get(req.replica or "") if req is not None else None
        if rep is not None and req is not None and req.state in (DISPATCHED, RUNNING):
            rep.failing = True  # suspect until a call there succeeds again
        return self._end_running(rid, now, FAILED, reason, output_tokens, None)

    def cancel(
        self, rid: str, now: float, reason: str = "client_disconnected", output_tokens: int = 0
    ) -> list[Decision]:
        """Cancel wherever the request is; a running one must also be aborted by the driver."""
        req = self.requests.get(rid)
        if req is None:
            out: list[Decision] = []
            self._advance(now, out)
            return out
        if req.state is QUEUED:
            out = []
            self._advance(now, out)
            if req.state is QUEUED:  # a timer may just have ended it
                self._unqueue(req)
                req.move(CANCELLED, reason)
                self._release_tenant(req, 0)
                self._record(req, now, out)
            self._fill(now, out)
            return out
        return self._end_running(rid, now, CANCELLED, reason, output_tokens, None)

    def reject_queued(self, now: float, reason: str = "shutting_down") -> list[Decision]:
        """Refuse everything still queued (graceful shutdown): each ends ``rejected`` with a
        ``retry_after`` hint. Running requests are left to finish, and so are paused ones whose
        client is already receiving its stream: they resume as slots free up."""
        out: list[Decision] = []
        for bucket in self.queued:
            for req in list(bucket.values()):
                if req.replica is not None and req.first_token_at is not None:
                    continue
                self._unqueue(req)
                req.retry_after = self._clamp_retry(0.0)
                req.move(REJECTED, reason)
                self._release_tenant(req, 0)
                self._record(req, now, out)
        return out

    def tick(self, now: float) -> list[Decision]:
        out: list[Decision] = []
        self._advance(now, out)
        self._fill(now, out)
        return out

    def next_timer(self) -> float | None:
        """When the driver should call ``tick`` at the latest (a timeout or a promotion is due,
        or a replica's cooling or ejection ends)."""
        timers = self._timers
        change = self._next_change
        while timers:
            when, _, req, gen = timers[0]
            if req.gen == gen and req.state is QUEUED:
                return when if when < change else change
            heapq.heappop(timers)
        return None if change == math.inf else change

    def snapshot(self, now: float, tenants: bool = False, tenant_waits: bool = True) -> Snapshot:
        """A frozen view of queues, replicas and counters (see ``core.snapshot``). The tenant
        rows' oldest waits walk the queued requests; without ``tenant_waits`` (a metrics
        scrape) the rows come from the per-tenant counts kept as requests queue, and read 0."""
        inflight = [0] * len(self.classes)
        for rep in self.replicas.values():
            for r in rep.inflight.values():
                inflight[r.class_level] += 1
        classes = []
        for c in self.classes:
            bucket = self.queued[c.level]
            oldest = 0.0
            if bucket:
                # insertion order is arrival order but for re-queued requests; a few suffice
                for i, r in enumerate(bucket.values()):
                    oldest = max(oldest, now - r.arrival)
                    if i >= 8:
                        break
            classes.append(ClassView(c.name, len(bucket), inflight[c.level], oldest))
        reps = tuple(
            ReplicaView(
                name=r.name,
                models=tuple(sorted(r.models)),
                window=r.window,
                inflight=len(r.inflight),
                up=r.up,
                eligible=r.name in self._usable_names and r.eligible(now),
                breaker=r.breaker.state(now),
                ejections=r.breaker.ejections,
                cooling_s=max(0.0, r.cooled_until - now),
                signals=r.signals,
                engine_itl_s=r.itl_s,
                others_held=r.others_held and r.strict_streams > 0,
                tpot_guard_s=self._guard_s(r),
            )
            for r in self.replicas.values()
        )
        rows: tuple[TenantView, ...] = ()
        per_replica: Counter[tuple[str, str]] = Counter()
        if tenants:
            acc: dict[tuple[str, str], list[float]] = {}
            if tenant_waits:
                for bucket in self.queued:
                    for r in bucket.values():
                        row = acc.setdefault((r.tenant, r.service_class), [0, 0, 0.0])
                        row[0] += 1
                        row[2] = max(row[2], now - r.arrival)
            else:
                for c, counts in zip(self.classes, self._tenant_queued, strict=True):
                    for tenant, n in counts.items():
                        acc[(tenant, c.name)] = [n, 0, 0.0]
            for rep in self.replicas.values():
                for r in rep.inflight.values():
                    acc.setdefault((r.tenant, r.service_class), [0, 0, 0.0])[1] += 1
                    per_replica[(rep.name, r.tenant)] += 1
            rows = tuple(
                TenantView(t, c, int(v[0]), int(v[1]), v[2]) for (t, c), v in sorted(acc.items())
            )
        return Snapshot(
            at=now,
            policy=self.policy.name,
            queued_total=self.queued_total,
            free_slots=self.free_slots,
            classes=tuple(classes),
            replicas=reps,
            tenants=rows,
            replica_tenants=tuple((*k, v) for k, v in sorted(per_replica.items())),
            preemptions=tuple(sorted(self.preemptions.items())),
            attempt_failures=tuple((*k, v) for k, v in sorted(self.attempt_failures.items())),
            retries=tuple((*k, v) for k, v in sorted(self.retries.items())),
            overtakes=tuple(sorted(self.overtakes.items())),
        )

    # ---------------------------------------------------------------- internals
    def _limiter(self, tenant: str, now: float) -> Limiter:
        lim = self._limiters.get(tenant)
        if lim is None:
            t = self._tenant_cfg.get(tenant)
            lim = self._limiters[tenant] = self.ledger.limiter(
                tenant, t.limits if t else TenantLimits(), now
            )
        return lim

    def _admission(
        self, req: Request, limiter: Limiter, now: float, out: list[Decision]
    ) -> tuple[str, float | None] | None:
        adm = self.cfg.admission
        if req.prompt_tokens > adm.max_prompt_tokens:
            return "prompt_too_long", None
        if req.max_tokens > adm.max_output_tokens or req.max_tokens < 1 or (
            req.ceiling is not None and req.max_tokens > req.ceiling
        ):
            return "invalid_max_tokens", None
        up_models = self._up_models
        if up_models is not None and (req.model not in up_models if req.model else not up_models):
            # every replica of its model is down: nothing to wait for in the queue (an ejected
            # or cooling one comes back by itself, and its requests wait for it instead)
            return "no_replica_available", self._clamp_retry(0.0)
        verdict = limiter.check(
            req.prompt_tokens + req.est_output_tokens, now
        )
        if verdict is not None:
            reason, wait = verdict
            return reason, self._clamp_retry(wait or self._slot_wait(now))
        cls = self.classes[req.level]
        if len(self.queued[req.class_level]) >= cls.max_queue:
            return "class_queue_full", self._clamp_retry(self._slot_wait(now))
        if self.queued_total:
            # honest overload: refuse now what would wait past what its class promises, with
            # the time after which the queue ahead is predicted to have drained enough
            level = req.level
            if cls.deadline_admission and self.policy.class_aware:
                # exact: budgets are short
                predicted = self.predicted_wait(level, now, cost=req.cost)
                budget = req.deadline - now
                if predicted is not None and predicted > budget and self._tenant_fair:
                    predicted = self.predicted_wait(level, now, req.tenant, req.class_level,
                                                    req.cost)
                if predicted is not None and predicted > budget:
                    return "deadline_infeasible", self._clamp_retry(predicted - budget)
            else:
                # a queue-timeout promise is tens of seconds: a reading up to
                # _PREDICT_EVERY_S old will do, and spares every admission the computation
                hit = self._predicted[level]
                if hit is not None and 0 <= now - hit[0] < _PREDICT_EVERY_S:
                    predicted = hit[1]
                else:
                    predicted = self.predicted_wait(level, now, cost=req.cost)
                    self._predicted[level] = (now, predicted)
            limit = self._admission_wait[level]
            if predicted is not None and predicted > limit and self._tenant_fair:
                # the class as a whole would wait too long: does this tenant's turn?
                predicted = self.predicted_wait(level, now, req.tenant, req.class_level,
                                                req.cost)
            if predicted is not None and predicted > limit:
                return "overloaded", self._clamp_retry(predicted - limit)
        if self.queued_total >= adm.max_queue_total and not self._displace_for(req, now, out):
            return "queue_full", self._clamp_retry(self._slot_wait(now))
        return None

    def _displace_for(self, req: Request, now: float, out: list[Decision]) -> bool:
        """Global cap reached: reject the newest queued request of the lowest class below
        ``req``'s, if there is one, to make room."""
        if not self.policy.class_aware:
            return False
        own = req.class_level
        for level in range(len(self.classes) - 1, own, -1):
            bucket = self.queued[level]
            if bucket:
                victim = bucket[next(reversed(bucket))]
                self._unqueue(victim)
                victim.retry_after = self._clamp_retry(self._slot_wait(now))
                victim.move(REJECTED, "displaced")
                self._release_tenant(victim, 0)
                self._record(victim, now, out)
                return True
        return False

    def predicted_wait(
        self, level: int, now: float, tenant: str | None = None, class_level: int | None = None,
        cost: float | None = None,
    ) -> float | None:
        """Seconds a new request of ``level`` is expected to wait before dispatch, from the
        queue ahead of it, the slots it could take (free ones, and for a class that may preempt,
        those held by preemptible less urgent requests) and the recent completion rate; None
        while no rate is known. With ``tenant`` (under a policy fair between tenants) only the
        tenant's share of its class's queue counts as ahead of it: each backlogged tenant gets a
        turn (VTC), so a flooder's backlog does not delay a light tenant. ``cost``: the
        arriving request's, for a class with no recent dispatches to take its mean from."""
        queued = self.queued
        cls = self.classes[level]
        if not self.policy.class_aware:
            ahead = float(self.queued_total)
        elif cls.strict:
            ahead = float(sum(len(queued[lv]) for lv in self._strict_levels if lv <= level))
        else:
            strict_ahead = sum(len(queued[lv]) for lv in self._strict_levels)
            own = len(queued[level])
            if tenant is not None and self._tenant_fair:
                tq = self._tenant_queued[level if class_level is None else class_level]
                mine = tq.get(tenant, 0)
                turns = len(tq) + (0 if mine else 1)
                own = min(own, (mine + 1) * turns)
            weights = 0.0 if queued[level] else cls.weight
            for lv, w in self._weighted_levels:
                if queued[lv]:
                    weights += w
            ahead = strict_ahead + own * weights / cls.weight
        room = self.free_slots
        if cls.can_preempt and self.policy.preemptive:
            # a slot held by a less urgent preemptible request is as good as free for this one
            room += sum(1 for r in self._preemptible.values() if r.level > level)
        if ahead < room:
            wait = 0.0
        else:
            rate = self._rate(now)
            if rate <= 0:
                return None
            wait = (ahead + 1 - room) / rate
        if self.policy.class_aware and not cls.strict and queued[level]:
            # backlogged: the class is served at the rate it has been getting, which counts what
            # overtakes it while it waits (strict arrivals, the other shares, the prefill
            # budget), and the estimate above, from the queue as it stands now, does not. A
            # backlog next to free room means the room is not the class's to use (the prefill
            # budget or the TPOT guard holds it): there too the served rate is what it gets.
            # But never less than its weighted share of what the non-strict classes were
            # served together: a class served less was held by a rule or had no traffic a
            # moment ago, not refused by a saturated engine, and the shares give it that much
            served = self._served[level].value(now)
            if self._one_pool:  # (where every replica serves the same models, they share slots)
                served = max(served, self._share_rate(level, weights, now, cost))
            if served > 0:
                wait = max(wait, (own + 1) / served)
        return wait

    def _share_rate(self, level: int, weights: float, now: float, cost: float | None) -> float:
        """Requests per second class ``level`` gets by its weight out of the service (in cost)
        the non-strict classes got together, ``weights`` being the backlogged classes' weights;
        its requests' cost is its own recent mean (or ``cost``, before it has one). 0 when
        nothing is known."""
        together = sum(self._served_cost[lv].value(now) for lv, _ in self._weighted_levels)
        if together <= 0:
            return 0.0
        served, served_cost = self._served[level].value(now), self._served_cost[level].value(now)
        mean = served_cost / served if served > 0 else cost
        if not mean:
            return 0.0
        return together * self.classes[level].weight / weights / mean

    def _rate(self, now: float) -> float:
        """The decayed completion rate, re-read at most every ``_RATE_EVERY_S``: it moves with
        a 10 s time constant, and every admission under a queue asks for it."""
        at, value = self._rate_at
        if now - at >= _RATE_EVERY_S or now < at:
            value = self.completions.value(now)
            self._rate_at = (now, value)
        return value

    def _slot_wait(self, now: float) -> float:
        rate = self._rate(now)
        return 1.0 / rate if rate > 0 else 0.0

    def _clamp_retry(self, seconds: float) -> float:
        adm = self.cfg.admission
        return min(adm.max_retry_after_s, max(adm.min_retry_after_s, seconds))

    def _enqueue(self, req: Request, now: float, arm: bool = True) -> None:
        req.move(QUEUED)
        req.enqueued_at = now
        self.policy.push(req)
        self.queued[req.class_level][req.id] = req
        self.queued_total += 1
        tq = self._tenant_queued[req.class_level]
        tq[req.tenant] = tq.get(req.tenant, 0) + 1
        req.expires_at = now + self.classes[req.class_level].queue_timeout_s
        self._set_aging(req, now)
        if arm:
            self._arm(req)

    def _set_aging(self, req: Request, now: float) -> None:
        req.ages_at = math.inf
        if self._aging and req.level > self._ceiling:
            after = self.classes[req.level].aging_after_s
            if after is not None:
                req.ages_at = now + after

    def _arm(self, req: Request) -> None:
        """One timer per queued request, for whichever comes first: its next promotion or its
        queue timeout (re-armed when it fires), so a submit costs one heap push."""
        self._timer_seq += 1
        timers = self._timers
        when = req.ages_at if req.ages_at < req.expires_at else req.expires_at
        heapq.heappush(timers, (when, self._timer_seq, req, req.gen))
        if len(timers) > 2 * self.queued_total + 1024:  # stale timers of dispatched requests
            live = [t for t in timers if t[2].gen == t[3] and t[2].state is QUEUED]
            heapq.heapify(live)
            self._timers = live

    def _advance(self, now: float, out: list[Decision]) -> None:
        """Fire the timers due at ``now`` (the hot handlers check ``timers[0]`` before calling)."""
        if now >= self._next_change:
            self._refresh(now)
        timers = self._timers
        while timers and timers[0][0] <= now:
            _, _, req, gen = heapq.heappop(timers)
            if req.gen != gen or req.state is not QUEUED:
                continue
            if now >= req.expires_at:
                self._unqueue(req)
                req.move(TIMED_OUT, "queue_timeout")
                self._release_tenant(req, 0)
                self._record(req, now, out)
            else:
                self._promote(req, now)
                self._arm(req)
            timers = self._timers

    def _promote(self, req: Request, now: float) -> None:
        """Aging: one level up, with the deadline a request of that level arriving *now* would
        have. Under strict bands that lifts it over the bands below; between weighted classes
        it stays in its own class's share (see ``policies``), where the earlier deadline puts it
        ahead of its class's younger requests. Counted from its original arrival, the deadline
        put it ahead of every native request of the level above under sustained overload."""
        self.policy.remove(req)
        req.level -= 1
        req.promotions += 1
        budget = self.classes[req.level].ttft_budget_ms / 1000.0
        req.deadline = min(req.deadline, now + budget)
        self.policy.push(req)
        self._set_aging(req, now)

    def _unqueue(self, req: Request) -> None:
        self.policy.remove(req)
        if req.replica is not None:
            self._paused_queued -= 1
        del self.queued[req.class_level][req.id]
        self.queued_total -= 1
        self._untenant(req)

    def _untenant(self, req: Request) -> None:
        tq = self._tenant_queued[req.class_level]
        n = tq[req.tenant] - 1
        if n:
            tq[req.tenant] = n
        else:
            del tq[req.tenant]

    def _fill(self, now: float, out: list[Decision]) -> None:
        policy = self.policy
        if self._budget_closed:  # the last fill's closures: this fill sees anew
            for closed in self._budget_closed:
                closed.budget_closed_below = BUDGET_OPEN
            self._budget_closed.clear()
        if (self._may_stall and self.free_slots > 0 and policy.root.n
                and self._nothing_may_go()):
            return  # nothing queued may go: popping and re-queueing each would cost, not serve
        held: list[Request] = []
        while self.free_slots > 0 and policy.root.n:
            req = policy.pop()
            assert req is not None
            rep = self._choose_replica(req, now)
            if rep is None:
                # paused on a full replica (it can only resume there), no replica of its
                # model has room, or a rule keeps the room from its class: set aside, the
                # next one in order may fit elsewhere (unless nothing queued may go now)
                held.append(req)
                if self._prefill_budget is not None:
                    self._close_budget_below(req)
                if len(held) >= _HOLD_MAX or (self._may_stall and self._nothing_may_go()):
                    break
                continue
            self._dispatch(req, rep, now, out)
        for req in held:
            policy.restore(req)  # popping charged it; it was not served, nor did it go idle

    def _nothing_may_go(self) -> bool:
        """No strict or paused request is queued and every replica with room keeps it from the
        other classes (it is the reserve, or the prefill budget is spent on their prompts, or
        the TPOT guard is on): no queued request may go anywhere. Conservative: True only
        where ``may_take`` would refuse every queued request."""
        budget = self._prefill_budget
        floor = self._reserve_floor
        lend: bool | None = None  # whether the reserve may be lent now (asked once, if at all)
        for rep in self._usable:
            if rep.free <= 0:
                continue
            room = self._reserve_room(rep, floor) if floor else None
            if room is None or room > 0:
                reserve_open = True
            elif room < 0 or rep.loan_streams:
                reserve_open = False
            else:
                if lend is None:
                    lend = self._may_lend()
                reserve_open = lend
            if reserve_open and not (rep.strict_streams and (
                (rep.others_held and rep.others_inflight)
                or (budget is not None and rep.other_prefill_tokens
                    and rep.prefill_tokens >= budget * rep.engine_share))) and not (
                    self._prompt_hold and self._strict_prompt_waits(rep)):
                return False  # the common case, and the cheapest test first
        return not self._paused_queued and not any(self.queued[lv] for lv in self._strict_levels)

    def _may_lend(self) -> bool:
        """Whether the reserve may be lent now: no class that may not borrow it waits (lent
        then, the slot would go to a lower class while a higher one, which may not use it,
        waits; and on an engine that cannot pause it stays lent for the borrower's stream)."""
        queued = self.queued
        return not any(queued[lv] for lv in self._unlent_levels)

    def may_take(self, rep: Replica, req: Request, now: float) -> bool:
        """Whether ``rep`` may take ``req`` now, room aside: it may take work, serves the
        model, keeps its reserved share for the classes above, and (while it streams to a
        strict class) keeps the prefill it has not answered within the budget."""
        if rep.name not in self._usable_names or not rep.serves(req.model):
            return False
        if req.replica is not None and req.replica != rep.name:
            return False  # paused: its state lives on that replica
        if req.avoid == rep.name and any(
            r is not rep and r.serves(req.model) for r in self._usable
        ):
            return False  # a retry waits for another replica while the model has one
        if rep.failing and rep.pending:
            return False  # suspect: one unanswered request at a time
        if (self._prompt_hold and req.replica is None and not self._strict[req.class_level]
                and self._strict_prompt_waits(rep)):
            return False
        return self._isolated_ok(rep, req, now)

    def _reserve_room(self, rep: Replica, frac: float) -> int | None:
        """Slots of ``rep`` beyond a reserve of ``frac`` of its window (None: no reserve): its
        free ones less the reserve, plus the reserve's slots on loan (each returns to it when
        its borrower ends: the borrower's debt, not the other classes'). On an engine that
        pauses, every request of a class that may be pulled back counts as free room too: the
        classes above can have its slot back at any time."""
        reserved = int(frac * rep.limit.limit)
        if not reserved:
            return None
        return rep.free + (rep.preemptible if rep.pausable else rep.loans) - reserved

    def _reserve_allows(self, rep: Replica, req: Request) -> bool:
        """The reserved share of ``rep``'s window for the classes above ``req``'s.

        What it guarantees them: on each replica, that many slots are free or held by requests
        they may pull back (a borrower that has sent nothing yet, or that pauses in-process),
        less the slots on loan to a borrower that has begun streaming on an engine that cannot
        pause (at most the reserve): such a slot returns to the reserve when that stream ends,
        and nothing more is lent until it has. Room beyond the reserve goes to whichever class
        the weighted shares pick, borrower or not, and a loan does not shrink it. The reserve
        is lent only to a class that may be pulled back, only while all of it is free or on
        loan, none of it to a stream, and only while no class that may not borrow waits:
        otherwise each slot a borrower frees would be again one only a borrower may take, and a
        higher class that may not borrow would starve behind a lower one."""
        frac = self._reserve_above[req.level]
        if not frac:
            return True
        room = self._reserve_room(rep, frac)
        if room is None or room >= 1:
            return True
        return (room == 0 and rep.free >= 1 and not rep.loan_streams
                and self._may_borrow[req.class_level] and self._may_lend())

    def _isolated_ok(self, rep: Replica, req: Request, now: float) -> bool:
        if not self._reserve_allows(rep, req):
            return False
        if not rep.strict_streams or req.replica is not None or self._strict[req.class_level]:
            return True
        if rep.others_held:
            if rep.others_inflight:
                # its streams are slow: realtime's time per token comes first; but one request
                # of the others at a time still goes (no starvation where realtime alone is slow)
                return False
        else:
            guard = self._guard_s(rep)
            if guard is not None and (rep.itl_s is None or rep.itl_s > 0.75 * guard) and any(
                    r.others_held for r in self._usable):
                # what a held replica does not take must not pile onto one close to its own
                # guard (without this, on fleet-mixed the H100s took what the slower A100s were
                # held off, and evicted from their KV caches: see docs/tpot_guard.md)
                return False
        budget = self._prefill_budget
        if budget is None:
            return True
        # past the budget, one prompt of the other classes at a time: however much realtime
        # prefill is pending, they still make progress (no starvation). A prompt the budget
        # holds keeps what is left of it from the classes below its own until it goes (see
        # _fill): else their shorter prompts would fit, and overtake it on every fill.
        # Realtime's own prompts are not held: that costs its TTFT more than its streams' TPOT
        # gains
        if req.class_level > rep.budget_closed_below:
            return False
        return self._fits_budget(rep, req, budget)

    def _fits_budget(self, rep: Replica, req: Request, budget: int) -> bool:
        return (rep.other_prefill_tokens == 0
                or rep.prefill_tokens + req.prompt_tokens <= budget * rep.engine_share)

    def _close_budget_below(self, req: Request) -> None:
        """``req`` (of a non-strict class) found no replica: where the prefill budget is what
        kept it out, close that replica's budget to the classes below it for this fill."""
        budget = self._prefill_budget
        if budget is None or self._strict[req.class_level]:
            return
        level = req.class_level
        for rep in self._usable:
            if (rep.strict_streams and rep.free > 0 and level < rep.budget_closed_below
                    and rep.serves(req.model) and req.replica in (None, rep.name)
                    and not self._fits_budget(rep, req, budget)):
                rep.budget_closed_below = level
                self._budget_closed.append(rep)

    def _suspects(self) -> bool:
        return any(r.failing for r in self._usable)

    def _choose_replica(self, req: Request, now: float) -> Replica | None:
        if req.replica is not None:  # paused: its state lives on that replica
            rep = self.replicas.get(req.replica)
            ok = rep is not None and rep.free > 0 and rep.name in self._usable_names
            return rep if ok else None
        usable = self._usable
        if not (self._any_model or not req.model):
            model = req.model
            usable = [r for r in usable if r.serves(model)]
        if self._reserve_above[req.level] or (
            self._hold_others and not self._strict[req.class_level]
        ):
            usable = [r for r in usable if self._isolated_ok(r, req, now)]
        if req.avoid is not None:  # a retry: another replica while the model has one
            others = [r for r in usable if r.name != req.avoid]
            if others:
                usable = others
        if self._suspects():
            usable = [r for r in usable if not (r.failing and r.pending)]
        if len(usable) == 1:  # nothing to choose between
            only = usable[0]
            rep = only if only.free > 0 else None
        else:
            rep = self.router.pick(req, usable, now)
        if (self._prompt_hold and rep is not None and not self._strict[req.class_level]
                and self._strict_prompt_waits(rep)):
            # held here, not sent elsewhere: as a filter before the router (sending them to
            # the replicas with no realtime prompt) it cost fleet-faults and fleet-mixed more
            # (docs/tpot_guard.md)
            return None
        return rep

    @staticmethod
    def _strict_prompt_waits(rep: Replica) -> bool:
        """A strict request's prompt was sent to ``rep`` and not answered yet (every prompt
        counts at least one token, so the strict classes' share of the pending tokens says it).
        The engine would fill that prompt's step with whatever else waits (vLLM fills each
        step's token budget): the other classes' prompts sent now would share realtime's
        prefill steps and lengthen them, the cost to realtime's TTFT that realtime alone does
        not pay."""
        return rep.prefill_tokens > rep.other_prefill_tokens

    def _dispatch(self, req: Request, rep: Replica, now: float, out: list[Decision],
                  over: bool = False) -> None:
        del self.queued[req.class_level][req.id]
        self.queued_total -= 1
        self._untenant(req)
        resume = req.replica is not None
        if resume:
            self._paused_queued -= 1
        req.move(DISPATCHED)
        req.replica = rep.name
        req.dispatched_at = now
        order = self.policy.order(req)
        if req.order is None or order < req.order:  # a retry or an aged request keeps its place
            req.order = order
        rep.inflight[req.id] = req
        if not self._strict[req.class_level]:
            rep.others_inflight += 1
        if resume and req.first_token_at is not None:
            # a stream paused after its first byte goes on: no new first byte will come
            req.move(RUNNING)
            self.policy.started(req)
            if self._strict[req.class_level]:
                rep.strict_streams += 1
        else:
            rep.prefill_tokens += req.prompt_tokens
            if not self._strict[req.class_level]:
                rep.other_prefill_tokens += req.prompt_tokens
            rep.pending += 1
            self._served[req.class_level].add(now)
            self._served_cost[req.class_level].add(now, req.cost)
        if over:
            self.overtakes[rep.name] += 1
        else:
            self.free_slots -= 1  # rep is usable: the router only sees usable replicas
        if self._may_borrow[req.class_level]:
            frac = self._reserve_above[req.level]
            if frac and not rep.pausable:
                room = self._reserve_room(rep, frac)  # (rep.free counts this dispatch)
                if room is not None and room < 0:  # it found no room beyond: a loan
                    req.lent = LENT_PREEMPTIBLE
                    rep.loans += 1
            self._preemptible[req.id] = req
            rep.preemptible += 1
        out.append(Dispatch(req, rep.name, resume))

    def _overtake_unstarted(self, now: float, out: list[Decision]) -> None:
        """Every window is full and a request arrived: the request qosgate would pick next may
        go past a full window to an engine that runs its queue in the order sent, when that
        engine holds requests of ours that have not started and that it would run before them.
        It then waits in the engine's queue ahead of them, and takes the next slot that engine
        frees, instead of waiting here for a slot of ours and then, in the engine, for the one
        after (the engine has given the first to the work it already held). Past the window by
        at most the number of unstarted requests it overtakes, so the engine's queue grows by
        no more than what it already held; what it runs (KV, batch) is the engine's to bound."""
        reps = [r for r in self._usable if r.ordered and r.pending]
        if not reps:
            return
        policy = self.policy
        req = policy.pop()
        if req is None:
            return
        best: Replica | None = None
        if req.replica is None:  # (a paused request resumes only where its state is)
            order = policy.order(req)
            if req.order is not None and req.order < order:
                order = req.order
            most = 0
            for rep in reps:
                over = max(0, len(rep.inflight) - rep.window)
                if rep.pending - over <= most or not self.may_take(rep, req, now):
                    continue  # (it could overtake no more than its unstarted requests)
                later = sum(1 for r in rep.inflight.values()
                            if r.state is DISPATCHED and r.order is not None and r.order > order)
                room = later - over
                if room > most:
                    best, most = rep, room
        if best is None:
            policy.restore(req)
            return
        self._dispatch(req, best, now, out, over=True)

    def _preempt_for(self, req: Request, now: float, out: list[Decision]) -> None:
        """Make room for ``req`` by pulling back the least urgent, most recently dispatched
        preemptible request below it that has sent nothing to its client yet (or, on a pausable
        engine, one that can pause at a token boundary)."""
        victim: Request | None = None
        for cand in self._preemptible.values():
            if cand.level <= req.level:
                continue
            if req.model and not self.replicas[cand.replica or ""].serves(req.model):
                continue  # its slot would be of no use to req
            if victim is None or (cand.level, cand.dispatched_at or 0.0) > (
                victim.level,
                victim.dispatched_at or 0.0,
            ):
                victim = cand
        if victim is None:
            return
        rep = self.replicas[victim.replica or ""]
        # a pausable engine keeps what the victim computed so far (even a partial prefill), so
        # pausing loses no work; elsewhere the engine call is aborted and its prefill redone
        pause = rep.pausable
        self._release_slot(victim)
        victim.move(PREEMPTED, "preempted")
        victim.preemptions += 1
        self.preemptions[victim.service_class] += 1
        self.policy.settle(victim, -victim.cost)  # refunded: charged again when re-dispatched
        victim.replica = rep.name if pause else None
        if pause:
            self._paused_queued += 1
        self._enqueue(victim, now)
        out.append(Preempt(victim, rep.name, pause))

    def _unmark_preemptible(self, req: Request) -> None:
        if self._preemptible.pop(req.id, None) is not None:
            rep = self.replicas.get(req.replica or "")
            if rep is not None:
                rep.preemptible -= 1

    def _release_slot(self, req: Request) -> None:
        self._unmark_preemptible(req)
        rep = self.replicas.get(req.replica or "")
        if req.lent and rep is not None:  # the loan is repaid: the slot is the reserve's again
            rep.loans -= 1
            if req.lent == LENT_STREAMING:
                rep.loan_streams -= 1
        req.lent = NOT_LENT
        if rep is None or rep.inflight.pop(req.id, None) is None:
            return
        if not self._strict[req.class_level]:
            rep.others_inflight -= 1
        if req.state is DISPATCHED:
            self.policy.started(req)  # it leaves unstarted
            rep.prefill_tokens -= req.prompt_tokens
            if not self._strict[req.class_level]:
                rep.other_prefill_tokens -= req.prompt_tokens
            rep.pending -= 1
        elif self._strict[req.class_level]:
            rep.strict_streams -= 1
        if len(rep.inflight) < rep.window and rep.name in self._usable_names:
            self.free_slots += 1

    def _end_running(
        self,
        rid: str,
        now: float,
        state: State,
        reason: str,
        output_tokens: int,
        prompt_tokens: int | None,
    ) -> list[Decision]:
        out: list[Decision] = []
        timers = self._timers
        if (timers and timers[0][0] <= now) or now >= self._next_change:
            self._advance(now, out)
        req = self.requests.get(rid)
        if req is None or req.state not in (DISPATCHED, RUNNING):
            self._fill(now, out)
            return out
        if prompt_tokens is not None:
            req.prompt_tokens = prompt_tokens
        if output_tokens < req.streamed:  # a cancel or failure mid-stream: what was sent counts
            output_tokens = req.streamed
        req.output_tokens = output_tokens
        self._release_slot(req)
        started = req.first_token_at is not None
        actual = (self._wp * req.prompt_tokens if started else 0.0) + self._wq * output_tokens
        self.policy.settle(req, actual - req.cost)
        if state is COMPLETED:
            self.completions.add(now)
            lvl = req.class_level
            self._out_est[lvl] += 0.05 * (output_tokens - self._out_est[lvl])
        req.move(state, reason)
        self._release_tenant(req, req.prompt_tokens + output_tokens if started else 0)
        self._record(req, now, out)
        if state is COMPLETED:
            self._guard_learns(req)
        self._fill(now, out)
        return out

    def _guard_learns(self, req: Request) -> None:
        """A strict stream ended: its TPOT against its budget, for its replica's guard."""
        budget = self._tpot_budget_s[req.class_level]
        if budget is None or self._guard_mode is None:
            return  # (the common case: a request of another class, or no guard)
        tpot = req.tpot
        rep = self.replicas.get(req.replica or "")
        if tpot is not None and rep is not None and rep.guard is not None:
            rep.guard.on_stream_ended(tpot / budget)

    def _release_tenant(self, req: Request, used_tokens: int) -> None:
        lim = self._limiters.get(req.tenant)
        if lim is not None:
            lim.release(req.charged_tpm, used_tokens, req.id)

    def _record(self, req: Request, now: float, out: list[Decision]) -> None:
        req.finished_at = now
        if req.avoid is not None:
            self._retrying -= 1
        self.requests.pop(req.id, None)  # (it left _preemptible with its slot)
        # the state is a StrEnum: it is its own label string
        self.outcomes[(req.service_class, req.tenant, req.state, req.reason)] += 1
        out.append(Finished(req))
