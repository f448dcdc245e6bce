"""The scheduler: events in, decisions out. Sans-I/O: the clock is always passed in.

One object drives the whole life of a request -- admission, queueing, aging, timeouts, dispatch to
a replica with a free slot, preemption, retries, and the single terminal outcome -- so the gateway
(asyncio, real time) and the simulator (virtual time) run exactly the same code. Every handler
first fires the timers that are due at ``now`` and ends by filling free slots (work-conserving:
nothing waits while a slot is free).

It orchestrates parts that answer queries and never call it back (vLLM's shape: its scheduler
owns a KV-cache manager): ``Admission`` gives a verdict on a newcomer, ``Timers`` say which queued
request is due, the ``Fleet`` says where a request may go and keeps each replica's books, the
``Backlog`` counts what waits, ``Pricing`` prices a request. Only the scheduler changes a request's
state and emits decisions.

Longer than most modules (about 730 lines): what is left is the request's state machine, one
short handler per event (submit, first byte, completion, failure, retry, cancel, timeout,
preemption, dispatch); split further, a request's life would be written in two places.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence

from qosgate.config import QosConfig, ServiceClass, TenantLimits
from qosgate.core.admission import Admission, Displace
from qosgate.core.backlog import Backlog
from qosgate.core.classifier import Classifier, QosInputs
from qosgate.core.decisions import Decision, Dispatch, Finished, Preempt
from qosgate.core.facts import AttemptFailed
from qosgate.core.fleet import Fleet
from qosgate.core.ledger import Limiter, LocalLedger, TenantLedger
from qosgate.core.model_limits import ModelLimiters
from qosgate.core.prefix import Prefix
from qosgate.core.pricing import Pricing
from qosgate.core.queueing import Policy, build_policy
from qosgate.core.ratelimit import Allowance
from qosgate.core.reasons import Reason, is_timeout
from qosgate.core.replica import Replica, ReplicaSpec
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
from qosgate.core.routing import Router
from qosgate.core.signals import LoadSignals
from qosgate.core.snapshot import Snapshot
from qosgate.core.timers import Timers
from qosgate.core.usage import Usage
from qosgate.core.weights import time_per_unit
from qosgate.core.windows import WindowRule

__all__ = ["ReplicaSpec", "Scheduler"]

_HOLD_MAX = 32  # requests set aside in one fill because no replica of theirs may take them
_NO_LEVEL = 1 << 30  # below every class: nothing held yet
# (an alias: ``Reason.X`` is a metaclass lookup, ~10x a global's, and every request completes)
_COMPLETED = Reason.COMPLETED


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
        ceiling = next(c.level for c in self.classes if c.name == cfg.aging.ceiling)
        self._tenant_cfg = {t.name: t for t in cfg.tenants}
        class_aware = self.policy.class_aware
        self.pricing = Pricing(cfg, self.classes)
        self.backlog = Backlog(self.classes)
        self.fleet = Fleet(cfg, self.classes, class_aware, ceiling, self.backlog, router,
                           self.pricing.weights)
        self.admission = Admission(cfg, self.classes, self.policy, self.backlog, self.fleet)
        self.timers = Timers(self.classes, cfg.aging.enabled and class_aware, ceiling)
        self.replicas: dict[str, Replica] = self.fleet.replicas
        self.router: Router = self.fleet.router
        # the requests in flight that may be pulled back (the fleet's; tests that stand in a
        # preemption rule of their own read it here)
        self._preemptible: dict[str, Request] = self.fleet.preemptible
        self.requests: dict[str, Request] = {}  # every live (non-terminal) request
        self._retrying = 0  # live requests on a retry (for the retry budget)
        # per level: whether an arrival there may pull a less urgent request back for room
        self._preempts = [c.can_preempt and self.policy.preemptive for c in self.classes]
        self._class_aware = class_aware
        self._overtake = cfg.fleet.window.overtake
        self._limiters: dict[str, Limiter] = {}
        # the tenants' limits on one model, beside their limits over all models
        self.model_limits = ModelLimiters(
            self.ledger, cfg.tenants, lambda model: self.pricing.weights.base_of(model), 0.0)
        # (class, replica, reason) -> count of attempts that failed before the first byte, and of
        # those that were retried; preemptions per class
        self.attempt_failures: Counter[tuple[str, str, str]] = Counter()
        self.retries: Counter[tuple[str, str, str]] = Counter()
        self.preemptions: Counter[str] = Counter()
        # streams evicted after their first byte (by class); streams moved to another replica
        # after theirs failed mid-stream (by class, reason); streams continued (by class)
        self.evictions: Counter[str] = Counter()
        self.moves: Counter[tuple[str, str]] = Counter()
        self.resumes: Counter[str] = Counter()
        # prompt tokens sent again to continue streams, and of those the engines had cached
        self.resent: Counter[str] = Counter()
        self.resent_cached: Counter[str] = Counter()
        # when a stream too fresh to evict for a waiting request may be (see ``tick``)
        self._evict_at = math.inf
        # dispatches past a full window, to overtake unstarted work in an ordered engine
        self.overtakes: Counter[str] = Counter()
        # (class, tenant, outcome, reason) -> count: the ledger both drivers report from
        self.outcomes: Counter[tuple[str, str, str, str]] = Counter()
        self.usage = Usage()  # per (tenant, model): requests, tokens, charged cost
        for spec in replicas:
            self.add_replica(spec)

    def retenant(self, cfg: QosConfig, now: float) -> None:
        """The tenants of ``cfg`` (their keys, tiers, weights, allowed classes and limits) and
        its tier boosts, for the requests that arrive from ``now``: a reload. A request already
        admitted keeps what it was admitted with (its class, its cost, its limiter's slot).
        ``cfg``'s classes must be this scheduler's: they shape every part (a change of classes
        needs a restart; the caller refuses it)."""
        if [c.model_dump() for c in cfg.classes] != [c.model_dump() for c in self.classes]:
            raise ValueError("the classes differ from the running ones")
        self.cfg = self.cfg.model_copy(update={
            "tenants": cfg.tenants, "tiers": cfg.tiers, "default_tenant": cfg.default_tenant})
        self.classifier.retenant(self.cfg)
        self._tenant_cfg = {t.name: t for t in self.cfg.tenants}
        self.pricing.retenant(self.cfg)
        self.fleet.reweigh(self.pricing.weights, now)
        weights = self.policy.tenant_weights
        weights.clear()
        weights.update({t.name: t.weight for t in self.cfg.tenants})
        self.policy.root.reweigh()
        for name, lim in self._limiters.items():
            t = self._tenant_cfg.get(name)
            lim.retune(t.limits if t is not None else TenantLimits(), now)
        self.model_limits.retenant(self.cfg.tenants, now)

    # ---------------------------------------------------------------- what the parts hold
    @property
    def queued(self) -> list[dict[str, Request]]:
        """Queued requests per service class, in queueing order."""
        return self.backlog.by_class

    @property
    def queued_total(self) -> int:
        return self.backlog.total

    @property
    def reads_prefix(self) -> bool:
        """Whether the router weighs a request's prefix keys (else nobody reads them)."""
        return self.fleet.router.reads_prefix

    @property
    def free_slots(self) -> int:
        return self.fleet.free_slots

    def may_take(self, rep: Replica, req: Request, now: float) -> bool:
        """Whether ``rep`` may take ``req`` now, room aside (``Fleet.may_take``)."""
        return self.fleet.may_take(rep, req, now)

    def predicted_wait(self, level: int, now: float, tenant: str | None = None,
                       class_level: int | None = None, cost: float | None = None) -> float | None:
        """Seconds a new request of ``level`` is expected to wait (``Admission.predicted_wait``)."""
        return self.admission.predicted_wait(level, now, tenant, class_level, cost)

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
        prefix: Prefix | None = None,
        session: str | None = None,
    ) -> Request:
        """Classify and build a request; raises QosInputError for unusable QoS inputs.

        ``max_tokens`` is the output cap the client asked for (None: none; see
        ``Pricing.price``). Either way admission charges the class's learned output length
        within that bound, and the real usage is settled at completion."""
        c = self.classifier.classify(inputs)
        cap, ceiling, est, cost = self.pricing.price(c.level, c.tenant, max_tokens,
                                                     prompt_tokens, context, model)
        req = Request(
            rid, c.tenant, c.service_class, c.level, now, now + c.budget_s, prompt_tokens, cap,
            requested_class=c.requested_class, est_output_tokens=int(est), model=model,
            prefix=prefix, session=session,
        )
        req.cost = cost
        req.ceiling = ceiling
        if model:
            req.load_cost = self.pricing.weights.load_cost(model)
        return req

    # ---------------------------------------------------------------- replicas
    def add_replica(self, spec: ReplicaSpec, window_rule: WindowRule | None = None) -> None:
        self.fleet.add(spec, window_rule)

    def retire_replica(self, name: str, now: float) -> list[Decision]:
        """``name`` left the config (a reload): no new work goes there; what runs there
        finishes. Its queued work goes elsewhere as the other replicas take it."""
        self.fleet.retire(name, now)
        out: list[Decision] = []
        self._advance(now, out)
        self._fill(now, out)
        return out

    def set_window(self, name: str, window: int, now: float) -> list[Decision]:
        """Set a fixed window (tests, operators); in-flight work is never cut."""
        self.fleet.set_window(name, window)
        out: list[Decision] = []
        self._advance(now, out)
        self.fleet.refresh(now)
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
        seen, before = rep.itl_seen, rep.signals
        self.fleet.observe(rep, now, up, models, signals)
        if signals is not None and self.pricing.weights.learning:
            self._learn_weight(rep, before, signals, rep.itl_seen != seen)
        self._fill(now, out)
        return out

    def _learn_weight(self, rep: Replica, before: LoadSignals | None, signals: LoadSignals,
                      new_itl: bool) -> None:
        """What ``rep``'s engine spent per token since its last scrape. An engine that accounts
        its time per model (``model_time``) says it for each model: engine seconds per unit of
        cost at the reference price (prompt and output tokens at the fairness weights), so
        that a weight learned from it makes the charge follow the engine time. Otherwise a
        replica serving one model (with its adapters) measures it by its mean inter-token
        latency (one step) over the sequences that shared each step; one serving several
        cannot say which of them took the time, and teaches nothing."""
        weights = self.pricing.weights
        if signals.model_time is not None:
            if before is not None and before.model_time is not None:
                for model, per_unit in time_per_unit(before.model_time, signals.model_time,
                                                     self.pricing.prompt_weight,
                                                     self.pricing.output_weight):
                    weights.measured(weights.base_of(model), per_unit, per_unit)
            return
        bases = {weights.base_of(m) for m in rep.models}
        if not new_itl or len(bases) != 1 or rep.itl_s is None:
            return
        running = signals.running or 1
        weights.measured(bases.pop(), None, rep.itl_s / max(1, running))

    def observe_cache(self, name: str, now: float, *, stored: Sequence[int] = (),
                      removed: Sequence[int] = (), cleared: bool = False) -> list[Decision]:
        """Replica ``name``'s engine stored or evicted prefix-cache blocks (``cleared``: it
        dropped them all), keys as ``wire.prefix.chain`` makes them: for a replica whose
        ``ReplicaSpec.cache_events`` is set, the router's index of it follows these."""
        out: list[Decision] = []
        self._advance(now, out)
        if name in self.replicas:
            self.router.observe_cache(name, now, stored, removed, cleared)
            self._fill(now, out)
        return out

    # ---------------------------------------------------------------- events
    def submit(self, req: Request, now: float) -> list[Decision]:
        out: list[Decision] = []
        if now >= self.timers.due or now >= self.fleet.next_change:
            self._advance(now, out)
        limiter = self._limiters.get(req.tenant)
        if limiter is None:
            limiter = self._limiter(req.tenant, now)
        limiter = self.model_limits.gate(limiter, req.tenant, req.model, now)
        verdict = self.admission.verdict(req, limiter, now)
        if verdict is not None:
            if not isinstance(verdict, Displace):
                req.retry_after = verdict.retry_after
                req.move(REJECTED, verdict.reason)
                self._record(req, now, out)
                return out
            # the queue is full: the newest request of a lower class makes room
            victim = verdict.victim
            self._unqueue(victim)
            victim.retry_after = verdict.retry_after
            victim.move(REJECTED, Reason.DISPLACED)
            self._release_tenant(victim, 0)
            self._record(victim, now, out)
        tokens = req.prompt_tokens + req.est_output_tokens
        limiter.admit(tokens, req.id)
        req.charged_tpm = tokens
        self.requests[req.id] = req
        self._enqueue(req, now, arm=False)
        fleet = self.fleet
        if fleet.free_slots:
            self._fill(now, out)
        elif self._preempts[req.level]:
            self._preempt_for(req, now, out)
            self._fill(now, out)
        if (self._overtake and fleet.ordered_usable and not fleet.free_slots
                and self.policy.root.n):
            self._overtake_unstarted(now, out)
        if req.state is QUEUED:  # a request dispatched at once needs no timer
            self.timers.arm(req, self.backlog.total)
        return out

    def first_byte(self, rid: str, now: float, token_at: float | None = None) -> bool:
        """The first byte of ``rid``'s response is about to reach its client: from here on it is
        never retried, nor preempted by abort. False if it may not be sent (the request was
        pulled back or ended meanwhile): the caller then sends nothing. ``token_at``: when the
        engine's first byte came, if earlier (a whole answer is read to its end before it
        reaches its client; its TTFT and the engine's latency are the engine's first byte).

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
                self.admission.first_token_seen(req, first)
            if req.avoid is not None:  # a retry that got through: out of the retry budget
                self._retrying -= 1
                req.avoid = None
            rep = self.replicas.get(req.replica or "")
            if rep is not None and self.fleet.started(req, rep, now, first):
                req.lent = LENT_STREAMING
            return True
        return state is QUEUED and req.replica is not None and req.first_token_at is not None

    def first_token(self, rid: str, now: float) -> list[Decision]:
        """``first_byte`` for drivers with no client (the simulator, tests): the first token is
        the first byte."""
        out: list[Decision] = []
        if now >= self.timers.due or now >= self.fleet.next_change:
            self._advance(now, out)
        self.first_byte(rid, now)
        if now >= self.fleet.next_change:  # it changed a window: the room goes to the queue
            self._advance(now, out)
            self._fill(now, out)
        return out

    def progress(self, rid: str, tokens: int) -> None:
        """``tokens`` output tokens have reached the client so far: what a cancel or a failure
        mid-stream charges the tenant."""
        req = self.requests.get(rid)
        if req is not None and tokens > req.streamed:
            req.streamed = tokens

    def attempt_failed(self, rid: str, now: float, fact: AttemptFailed) -> list[Decision]:
        """An engine call failed before the first byte reached the client (``AttemptFailed``
        says how). The replica learns of it; the request is re-queued in its place (same
        deadline) for another replica while its attempts and the retry budget allow; else it
        ends ``failed`` (or ``timed_out`` for a timeout reason)."""
        out: list[Decision] = []
        self._advance(now, out)
        req = self.requests.get(rid)
        if req is None or req.state is not DISPATCHED:
            if req is not None and req.state is RUNNING:  # a byte went out: never retried
                return self._end_running(rid, now, FAILED, fact.reason, 0, None)
            self._fill(now, out)
            return out
        reason = fact.reason
        rep = self.replicas.get(req.replica or "")
        name = req.replica or ""
        self.attempt_failures[(req.service_class, name, reason)] += 1
        if rep is not None:
            latency = now - (req.dispatched_at or now)
            self.fleet.attempt_failed(rep, now, latency, fact)
        self._release_slot(req)
        self.fleet.refresh(now)
        req.failures += 1
        # the budget bounds retries that add load; a replica that refused the connection
        # took none, and a request already retrying is counted once
        retry = fact.retryable and req.failures < self.cfg.fleet.retries.max_attempts and (
            req.avoid is not None or fact.unreachable or self._retry_budget_left()
        )
        self.policy.settle(req, -req.cost)  # served nothing (charged again if re-dispatched)
        if not retry:
            req.move(TIMED_OUT if is_timeout(reason) else FAILED, reason)
            req.retry_after = fact.retry_after
            self._release_tenant(req, 0)
            self._record(req, now, out)
            self._fill(now, out)
            return out
        if req.avoid is None:
            self._retrying += 1
        req.avoid = name
        self.retries[(req.service_class, name, reason)] += 1
        req.replica = None
        self._enqueue(req, now)
        self._fill(now, out)
        return out

    def stream_broke(self, rid: str, now: float, fact: AttemptFailed) -> list[Decision]:
        """A stream's engine call failed after its first byte reached the client (its replica
        died, hung or broke the stream: ``fact`` says how). A stream that can continue
        elsewhere (``Request.resumable``, on an engine that continues from token ids) is
        queued again in its place, to go on from its last delivered token on another replica,
        while it has moves left (``fleet.retries.max_moves``, as Dynamo's migration limit);
        else it ends ``failed`` (``timed_out`` for a timeout reason), its client's stream
        closed with an error event. A move counts as a failed attempt of that replica."""
        out: list[Decision] = []
        self._advance(now, out)
        req = self.requests.get(rid)
        if req is None or req.state is not RUNNING:
            self._fill(now, out)
            return out
        reason = fact.reason
        name = req.replica or ""
        rep = self.replicas.get(name)
        if not (req.resumable and rep is not None and rep.resumes
                and req.moves < self.cfg.fleet.retries.max_moves):
            return self._end_running(rid, now, TIMED_OUT if is_timeout(reason) else FAILED,
                                     reason, 0, None)
        # a failed engine call the request goes on from: the replica learns of it
        self.attempt_failures[(req.service_class, name, reason)] += 1
        self.fleet.attempt_failed(rep, now, now - (req.dispatched_at or now), fact)
        self._release_slot(req)
        self.fleet.refresh(now)
        self.policy.settle(req, -req.cost)  # charged again when it goes on
        req.moves += 1
        self.moves[(req.service_class, reason)] += 1
        req.move(PREEMPTED, reason)
        req.replica = None
        if req.avoid is None:
            self._retrying += 1
        req.avoid = name  # another replica while the model has one
        self._enqueue(req, now)
        self._fill(now, out)
        return out

    def continued(self, rid: str, prompt_tokens: int, cached_tokens: int | None) -> None:
        """A continuation of ``rid`` sent ``prompt_tokens`` again (its prompt and the tokens it
        had produced), of which its engine said it had ``cached_tokens`` in its prefix cache
        (None: it did not say): what an eviction or a move cost."""
        req = self.requests.get(rid)
        if req is None:
            return
        self.resent[req.service_class] += prompt_tokens
        if cached_tokens:
            self.resent_cached[req.service_class] += cached_tokens

    def unresumable(self, rid: str) -> None:
        """``rid``'s answer turned out not to continue exactly (the engine returned no token
        ids, or a delta a continuation cannot write): it is no longer evicted after its first
        byte, nor moved when its replica fails."""
        req = self.requests.get(rid)
        if req is not None and req.resumable:
            req.resumable = False
            self.fleet.unresumable(req)

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
        self, rid: str, now: float, output_tokens: int, prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> list[Decision]:
        """``cached_tokens``: of the prompt, what the engine says it took from its prefix cache
        (None: it did not say; the router's estimate at placement stands).

        Fairness charges the tokens the engine computed: the tenant's fair-share counters
        (the class shares and per-tenant VTC) are charged the prompt less its cached part,
        because they divide engine time and a cached token costs the engine none; the
        router's estimate is credited at placement and the engine's count settles it here.
        The tenant's tokens-per-minute limit still counts the whole prompt: it is a quota on
        what the tenant sends (as providers count TPM), and must not depend on where a
        request happened to land."""
        if cached_tokens is not None:
            req = self.requests.get(rid)
            if req is not None and req.state in (DISPATCHED, RUNNING):
                req.cached_tokens = cached_tokens  # what the final settlement charges less
        return self._end_running(
            rid, now, COMPLETED, _COMPLETED, output_tokens, prompt_tokens
        )

    def fail(self, rid: str, now: float, reason: str, output_tokens: int = 0) -> list[Decision]:
        req = self.requests.get(rid)
        rep = self.replicas.get(req.replica or "") if req is not None else None
        if rep is not None and req is not None and req.state in (DISPATCHED, RUNNING):
            rep.failing = True  # suspect until a call there succeeds again
        return self._end_running(rid, now, FAILED, reason, output_tokens, None)

    def cancel(
        self, rid: str, now: float, reason: str = Reason.CLIENT_DISCONNECTED,
        output_tokens: int = 0,
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

    def reject_queued(self, now: float, reason: str = Reason.SHUTTING_DOWN) -> list[Decision]:
        """Refuse everything still queued (graceful shutdown): each ends ``rejected`` with a
        ``retry_after`` hint. Running requests are left to finish, and so are paused ones whose
        client is already receiving its stream: they resume as slots free up."""
        out: list[Decision] = []
        for bucket in self.backlog.by_class:
            for req in list(bucket.values()):
                if req.first_token_at is not None:  # paused or evicted mid-stream
                    continue
                self._unqueue(req)
                req.retry_after = self.admission.clamp_retry(0.0)
                req.move(REJECTED, reason)
                self._release_tenant(req, 0)
                self._record(req, now, out)
        return out

    def tick(self, now: float) -> list[Decision]:
        out: list[Decision] = []
        self._advance(now, out)
        if now >= self._evict_at:
            self._evict_at = math.inf
            self._preempt_for_waiting(now, out)
        self._fill(now, out)
        return out

    def _preempt_for_waiting(self, now: float, out: list[Decision]) -> None:
        """A stream too fresh to evict when a more urgent request came has run its minimum
        now: each request of a class that may preempt still waiting takes a slot, as it would
        have on arrival."""
        by_class = self.backlog.by_class
        for level, may in enumerate(self._preempts):
            if not may or not by_class[level]:
                continue
            for req in list(by_class[level].values()):
                if req.state is not QUEUED:
                    continue  # (dispatched by the fill below, for an earlier one's victim)
                if not self.fleet.free_slots:
                    self._preempt_for(req, now, out)
                    if not self.fleet.free_slots:
                        return  # no victim now (a later one may be due: ``_evict_at``)
                self._fill(now, out)

    def next_timer(self) -> float | None:
        """When the driver should call ``tick`` at the latest (a timeout or a promotion is due,
        or a replica's cooling or ejection ends)."""
        change = self.fleet.next_change
        when = self.timers.next_at()
        if when is not None:
            return when if when < change else change
        return None if change == math.inf else change

    def snapshot(self, now: float, tenants: bool = False, tenant_waits: bool = True) -> Snapshot:
        """A frozen view of queues, replicas and counters (see ``core.snapshot``). The tenant
        rows' oldest waits walk the queued requests; without ``tenant_waits`` (a metrics
        scrape) the rows come from the per-tenant counts kept as requests queue, and read 0."""
        backlog, fleet = self.backlog, self.fleet
        inflight = fleet.inflight_per_class(len(self.classes))
        rows, per_replica = (backlog.tenant_rows(self.classes, fleet.replicas.values(), now,
                                                 tenant_waits) if tenants else ((), ()))
        return Snapshot(
            at=now,
            policy=self.policy.name,
            queued_total=backlog.total,
            free_slots=fleet.free_slots,
            classes=tuple(backlog.class_view(c.name, c.level, inflight[c.level], now)
                          for c in self.classes),
            replicas=fleet.views(now),
            tenants=rows,
            replica_tenants=per_replica,
            preemptions=tuple(sorted(self.preemptions.items())),
            evictions=tuple(sorted(self.evictions.items())),
            moves=tuple(sorted((c, r, n) for (c, r), n in self.moves.items())),
            resumes=tuple(sorted(self.resumes.items())),
            resent=tuple(sorted((c, n, self.resent_cached[c]) for c, n in self.resent.items())),
            attempt_failures=tuple((*k, v) for k, v in sorted(self.attempt_failures.items())),
            retries=tuple((*k, v) for k, v in sorted(self.retries.items())),
            overtakes=tuple(sorted(self.overtakes.items())),
            calibration=self.admission.calibration_view(),
            bookings=(self.admission.bookings.made, self.admission.bookings.kept,
                      self.admission.bookings.lapsed),
            usage=self.usage.rows() if tenants else (),
            model_weights=self.pricing.weights.view() if tenants else {},
        )

    def allowance(self, tenant: str, now: float, model: str = "") -> Allowance:
        """What ``tenant`` has left of its limits at ``now`` (nothing is charged); with
        ``model``, of its limits on that model too, whichever binds first."""
        lim = self._limiter(tenant, now)
        if model:
            lim = self.model_limits.gate(lim, tenant, model, now)
        return lim.allowance(now)

    def limited_models(self, tenant: str) -> tuple[str, ...]:
        """The models ``tenant`` has limits of its own on (``limits.models``)."""
        t = self._tenant_cfg.get(tenant)
        return tuple(sorted(t.limits.models)) if t is not None else ()

    # ---------------------------------------------------------------- internals
    def _limiter(self, tenant: str, now: float) -> Limiter:
        lim = self._limiters.get(tenant)
        if lim is None:
            t = self._tenant_cfg.get(tenant)
            lim = self._limiters[tenant] = self.ledger.limiter(
                tenant, t.limits if t else TenantLimits(), now
            )
        return lim

    def _enqueue(self, req: Request, now: float, arm: bool = True) -> None:
        if req.cached_tokens:  # back from a replica: whole again until placed anew
            req.cost += self.pricing.prompt_cost(req.cached_tokens, req.model)
            req.cached_tokens = 0
        req.move(QUEUED)
        req.enqueued_at = now
        self.policy.push(req)
        self.backlog.add(req)
        timers = self.timers
        req.expires_at = timers.expiry(req, now)
        req.ages_at = timers.ages_at(req, now)
        if arm:
            timers.arm(req, self.backlog.total)

    def _unqueue(self, req: Request) -> None:
        self.policy.remove(req)
        if req.replica is not None:
            self.backlog.paused -= 1
        self.backlog.remove(req)

    def _advance(self, now: float, out: list[Decision]) -> None:
        """Fire the timers due at ``now`` (the hot handlers check ``Timers.due`` before
        calling)."""
        if now >= self.fleet.next_change:
            self.fleet.refresh(now)
        timers = self.timers
        while (req := timers.pop_due(now)) is not None:
            if now >= req.expires_at:
                self._unqueue(req)
                req.move(TIMED_OUT, Reason.QUEUE_TIMEOUT)
                self._release_tenant(req, 0)
                self._record(req, now, out)
            else:
                self._promote(req, now)
                timers.arm(req, self.backlog.total)

    def _promote(self, req: Request, now: float) -> None:
        """Aging: one level up, with the deadline a request of that level arriving *now* would
        have. Under strict bands that lifts it over the bands below; between weighted classes
        it stays in its own class's share (see ``queueing.policies``), where the earlier
        deadline puts it ahead of its class's younger requests. Counted from its original
        arrival, the deadline put it ahead of every native request of the level above under
        sustained overload."""
        self.policy.remove(req)
        req.level -= 1
        req.promotions += 1
        budget = self.classes[req.level].ttft_budget_ms / 1000.0
        req.deadline = min(req.deadline, now + budget)
        self.policy.push(req)
        req.ages_at = self.timers.ages_at(req, now)

    def _fill(self, now: float, out: list[Decision]) -> None:
        policy = self.policy
        fleet = self.fleet
        if fleet.budget_closed or fleet.room_held:  # the last fill's closures: this fill sees anew
            fleet.reopen_budgets()
        if (fleet.may_stall and fleet.free_slots > 0 and policy.root.n
                and fleet.nothing_may_go()):
            return  # nothing queued may go: popping and re-queueing each would cost, not serve
        while True:
            held: list[Request] = []
            lending_withheld = False  # at the first hold, the reserve was lent to no one
            held_above = _NO_LEVEL  # the highest class (lowest level) held in this pass
            while fleet.free_slots > 0 and policy.root.n:
                req = policy.pop()
                assert req is not None
                if (lending_withheld and req.class_level > held_above
                        and not fleet.lending_withheld()):
                    # the reserve opened in this pass (the last class that may not borrow it
                    # went): a higher class held before this one may borrow it first, so this
                    # one goes back unplaced and the next pass takes them again in their order
                    policy.restore(req)
                    break
                rep = fleet.choose(req, now)
                if rep is None:
                    # paused on a full replica (it can only resume there), no replica of its
                    # model has room, or a rule keeps the room from its class: set aside, the
                    # next one in order may fit elsewhere (unless nothing queued may go now)
                    if not held:
                        lending_withheld = fleet.lending_withheld()
                    held.append(req)
                    held_above = min(held_above, req.class_level)
                    if fleet.prefill_budget is not None:
                        fleet.close_budget_below(req)
                    if req.model and fleet.costed:
                        fleet.hold_room(req)
                    if (len(held) >= _HOLD_MAX and not fleet.reserve_waits()) or (
                            fleet.may_stall and fleet.nothing_may_go()):
                        break
                    continue
                self._dispatch(req, rep, now, out)
            for req in held:
                policy.restore(req)  # popping charged it; it was not served, nor did it go idle
            # the reserve is lent only while no class that may not borrow it waits: if the
            # last of those went in this fill, the borrowers held before that may take it now
            # (else they wait beside it until some later event), before any popped after them;
            # a second pass cannot open it again, since the queue only shrinks within a fill
            if not (lending_withheld and fleet.free_slots > 0 and not fleet.lending_withheld()):
                break

    def _dispatch(self, req: Request, rep: Replica, now: float, out: list[Decision],
                  over: bool = False) -> None:
        self.backlog.remove(req)
        paused = req.replica is not None
        if paused:
            self.backlog.paused -= 1
        # paused in an engine, or a stream that continues from the tokens it delivered
        resume = paused or req.first_token_at is not None
        req.move(DISPATCHED)
        req.replica = rep.name
        req.dispatched_at = now
        order = self.policy.order(req)
        if req.order is None or order < req.order:  # a retry or an aged request keeps its place
            req.order = order
        streaming = req.first_token_at is not None
        if streaming:
            # a stream paused or evicted after its first byte goes on: no new first byte will
            # come
            req.move(RUNNING)
            self.policy.started(req)
            if not paused:
                self.resumes[req.service_class] += 1
                if req.avoid is not None:  # moved off a failed replica: it has another now
                    self._retrying -= 1
                    req.avoid = None
        elif self._class_aware:  # (only a class-aware admission reads the served rates)
            self.admission.served(req, now)
        if over:
            self.overtakes[rep.name] += 1
        loads = req.loads
        if self.fleet.place(req, rep, now, paused, streaming, over):
            req.lent = LENT_PREEMPTIBLE
        if req.loads != loads:  # it makes ``rep`` load its adapter: its tenant pays the load
            req.cost += req.load_cost
            self.policy.settle(req, req.load_cost)
        if req.cached_tokens:  # what its replica is expected to hold is not charged
            credit = self.pricing.prompt_cost(req.cached_tokens, req.model)
            req.cost -= credit
            self.policy.settle(req, -credit)
        out.append(Dispatch(req, rep.name, resume))

    def _overtake_unstarted(self, now: float, out: list[Decision]) -> None:
        """Every window is full and a request arrived: the request qosgate would pick next may
        go past a full window to an engine that runs its queue in the order sent, when that
        engine holds requests of ours that have not started and that it would run before them.
        It then waits in the engine's queue ahead of them, and takes the next slot that engine
        frees, instead of waiting here for a slot of ours and then, in the engine, for the one
        after (the engine has given the first to the work it already held). What it runs (KV,
        batch) is the engine's to bound (``Fleet.overtake_target``)."""
        fleet = self.fleet
        if not fleet.may_overtake():
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
            best = fleet.overtake_target(req, order, now)
        if best is None:
            policy.restore(req)
            return
        self._dispatch(req, best, now, out, over=True)

    def _preempt_for(self, req: Request, now: float, out: list[Decision]) -> None:
        """Make room for ``req`` by pulling back the least urgent, most recently dispatched
        preemptible request below it that has sent nothing to its client yet (or, on a pausable
        engine, one that can pause at a token boundary)."""
        fleet = self.fleet
        victim = fleet.preemption_victim(req, now)
        if victim is None:
            if fleet.victim_at < self._evict_at:  # a stream will be evictable then: look again
                self._evict_at = fleet.victim_at
                if fleet.victim_at < fleet.next_change:
                    fleet.next_change = fleet.victim_at
            return
        rep = self.replicas[victim.replica or ""]
        # a pausable engine keeps what the victim computed so far (even a partial prefill), so
        # pausing loses no work; elsewhere the engine call is aborted and its prefill redone
        # (a stream evicted after its first byte continues later from the tokens it delivered)
        pause = rep.pausable
        if not pause and victim.state is RUNNING:
            victim.evictions += 1
            self.evictions[victim.service_class] += 1
        self._release_slot(victim)
        victim.move(PREEMPTED, Reason.PREEMPTED)
        victim.preemptions += 1
        self.preemptions[victim.service_class] += 1
        self.policy.settle(victim, -victim.cost)  # refunded: charged again when re-dispatched
        victim.replica = rep.name if pause else None
        if pause:
            self.backlog.paused += 1
        self._enqueue(victim, now)
        out.append(Preempt(victim, rep.name, pause))

    def _release_slot(self, req: Request) -> None:
        if self.fleet.release(req):
            self.policy.started(req)  # it leaves unstarted
        req.lent = NOT_LENT

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
        if now >= self.timers.due or now >= self.fleet.next_change:
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
        if self.fleet.release(req):  # (``_release_slot``, inline: on every end)
            self.policy.started(req)
        req.lent = NOT_LENT
        started = req.first_token_at is not None
        computed = req.prompt_tokens
        if req.cached_tokens:
            computed = max(0, computed - req.cached_tokens)
        used = self.pricing.used(computed, output_tokens, started, req.model)
        used += req.loads * req.load_cost
        self.policy.settle(req, used - req.cost)
        self.usage.add(req.tenant, req.model, req.prompt_tokens if started else 0,
                       output_tokens, used)
        if state is COMPLETED:
            self.admission.completed(req, now)
            self.pricing.learn(req.class_level, output_tokens)
        req.move(state, reason)
        used_tokens = req.prompt_tokens + output_tokens if started else 0
        lim = self._limiters.get(req.tenant)  # (``_release_tenant``, inline: on every end)
        if lim is not None:
            lim.release(req.charged_tpm, used_tokens, req.id)
        self.model_limits.release(req.charged_tpm, used_tokens, req.id)
        self._record(req, now, out)
        if state is COMPLETED and self.fleet.guard_mode is not None:
            self.fleet.stream_ended(req)
        self._fill(now, out)
        return out

    def _release_tenant(self, req: Request, used_tokens: int) -> None:
        lim = self._limiters.get(req.tenant)
        if lim is not None:
            lim.release(req.charged_tpm, used_tokens, req.id)
        self.model_limits.release(req.charged_tpm, used_tokens, req.id)

    def _record(self, req: Request, now: float, out: list[Decision]) -> None:
        req.finished_at = now
        if req.forecast and req.first_token_at is None:
            self.admission.unanswered(req, now)
        if req.avoid is not None:
            self._retrying -= 1
        self.requests.pop(req.id, None)  # (it left the preemptible ones with its slot)
        # the state is a StrEnum: it is its own label string
        self.outcomes[(req.service_class, req.tenant, req.state, req.reason)] += 1
        out.append(Finished(req))
