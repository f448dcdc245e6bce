"""Admission: whether a new request may join the queue, and how long it is predicted to wait.

``Admission.verdict`` answers with ``None`` (admit: the common case builds nothing), a
``Refusal`` (reason and Retry-After), or ``Displace`` (the queue is full, but the newest queued
request of a lower class makes room). It changes nothing of a request but to note the TTFT it
forecast for it (``Request.forecast``, what the answer calibrates later): the scheduler carries
out the verdict. Its first rule, the configured size limits (``over_limit``), is also the gateway's
before it queues anything: its ``OverLimit`` says the value, the limit and whose it is. It reads
the queue's books (``Backlog``) and the fleet's free room, and learns the service rates and
first-token times it forecasts from, and how late its forecasts were, as the scheduler tells it
of dispatches, first tokens and completions (``core.forecast``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from qosgate.config import Admission as AdmissionConfig
from qosgate.config import QosConfig, ServiceClass
from qosgate.core.backlog import Backlog
from qosgate.core.bookings import Bookings
from qosgate.core.fleet import Fleet
from qosgate.core.forecast import Calibration, FirstTokenTime
from qosgate.core.ledger import Limiter
from qosgate.core.peers import PeerLoad
from qosgate.core.queueing import Policy
from qosgate.core.reasons import Reason
from qosgate.core.request import Request

_RATE_EVERY_S = 0.05  # how long admission reuses a reading of the completion rate
_PREDICT_EVERY_S = 0.05  # ... and a predicted wait against a queue-timeout promise


@dataclass(frozen=True, slots=True)
class Refusal:
    """Refuse the request: ``reason``, and when to retry (None: retrying will not help)."""

    reason: str
    retry_after: float | None


@dataclass(frozen=True, slots=True)
class OverLimit:
    """A request past a configured size limit (``reason``), with what its client is told: its
    ``value`` (prompt tokens, or an output cap), the ``limit`` it is past, and whether that
    limit is the output ``ceiling`` of its class or tenant rather than the gateway's own."""

    reason: str
    value: int
    limit: int
    ceiling: bool = False


def over_limit(req: Request, limits: AdmissionConfig) -> OverLimit | None:
    """The configured size limit ``req`` is past, if any: its prompt first, then its output
    cap."""
    if req.prompt_tokens > limits.max_prompt_tokens:
        return OverLimit(Reason.PROMPT_TOO_LONG, req.prompt_tokens, limits.max_prompt_tokens)
    return output_over(req.max_tokens, req, limits)


def output_over(value: int, req: Request, limits: AdmissionConfig) -> OverLimit | None:
    """``value`` as an output cap of ``req``: None from 1 to the lower of the gateway's limit and
    the request's ceiling, else the refusal saying which."""
    most = limits.max_output_tokens
    ceiling = req.ceiling
    if ceiling is not None and ceiling < most:
        if 1 <= value <= ceiling:
            return None
        return OverLimit(Reason.INVALID_MAX_TOKENS, value, ceiling, True)
    if 1 <= value <= most:
        return None
    return OverLimit(Reason.INVALID_MAX_TOKENS, value, most)


@dataclass(frozen=True, slots=True)
class Displace:
    """Admit the request, rejecting ``victim`` (queued, of a lower class) to make room."""

    victim: Request
    retry_after: float


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
        # (``_decayed`` inline, and max(0.0, elapsed) as a test: the same floats, without two
        # calls, one of them a builtin that parses keywords)
        tau = self.tau
        elapsed = now - self._stamp
        self._value = (self._value * math.exp(-(elapsed if elapsed > 0.0 else 0.0) / tau)
                       + amount / tau)
        self._stamp = now
        self._count += 1

    def _decayed(self, now: float) -> float:
        return self._value * math.exp(-max(0.0, now - self._stamp) / self.tau)

    def value(self, now: float) -> float:
        if self._count < self.min_events or self._first is None:
            return 0.0
        seen = 1.0 - math.exp(-max(0.0, now - self._first) / self.tau)
        return self._decayed(now) / seen if seen > 1e-9 else 0.0


class ServedRate(DecayingRate):
    """A class's first dispatches per second (``value``) and their cost per second
    (``cost_value``): always added together, so one decay factor serves both (the same floats
    as two ``DecayingRate``s, one ``exp`` less per dispatch)."""

    __slots__ = ("_cost",)

    def __init__(self) -> None:
        super().__init__()
        self._cost = 0.0

    def add_served(self, now: float, cost: float) -> None:
        """One dispatch of ``cost``."""
        if self._first is None:
            self._first = now
        tau = self.tau
        elapsed = now - self._stamp  # (max(0.0, elapsed) as a test, as in ``add``)
        decay = math.exp(-(elapsed if elapsed > 0.0 else 0.0) / tau)
        self._value = self._value * decay + 1.0 / tau
        self._cost = self._cost * decay + cost / tau
        self._stamp = now
        self._count += 1

    def cost_value(self, now: float) -> float:
        if self._count < self.min_events or self._first is None:
            return 0.0
        tau = self.tau
        seen = 1.0 - math.exp(-max(0.0, now - self._first) / tau)
        decayed = self._cost * math.exp(-max(0.0, now - self._stamp) / tau)
        return decayed / seen if seen > 1e-9 else 0.0


class BusyRate:
    """Completions per second of the time the fleet was saturated (a queue, or no free slot):
    what the engines can do, where a plain completion rate says how much they were sent. Both
    counts decay with ``tau`` seconds of busy time; it knows nothing (0) until ``min_events``
    completions came while busy, over at least ``tau`` busy seconds."""

    __slots__ = ("_count", "_last", "_time", "events", "min_events", "seconds", "tau")

    def __init__(self, tau: float = 20.0, min_events: int = 20) -> None:
        self.tau = tau
        self.min_events = min_events
        self._count = 0.0
        self._time = 0.0
        self._last: float | None = None
        self.events = 0
        self.seconds = 0.0  # busy seconds seen, not decayed

    def add(self, now: float, busy: bool) -> None:
        """A completion at ``now``; ``busy``: whether the fleet was saturated until then."""
        last = self._last
        self._last = now
        if not busy or last is None:
            return
        dt = now - last if now > last else 0.0  # (completions of one engine step come together)
        decay = math.exp(-dt / self.tau)
        self._count = self._count * decay + 1.0
        self._time = self._time * decay + dt
        self.seconds += dt
        self.events += 1

    def value(self) -> float:
        if self.events < self.min_events or self.seconds < self.tau:
            # (its first busy seconds are the engines' ramp: what completes then is what began
            # before, and would read low)
            return 0.0
        return self._count / self._time


class Admission:
    __slots__ = (
        "_admission_wait",
        "_backlog",
        "_budgets",
        "_classes",
        "_fleet",
        "_model_first",
        "_policy",
        "_predicted",
        "_rate_at",
        "_served",
        "_service_s",
        "_strict_in",
        "_weighted_levels",
        "bookings",
        "busy",
        "calibration",
        "cfg",
        "completions",
        "first_token",
        "peers",
    )

    def __init__(self, cfg: QosConfig, classes: list[ServiceClass], policy: Policy,
                 backlog: Backlog, fleet: Fleet) -> None:
        self.cfg = cfg.admission
        self._classes = classes  # the scheduler's own list: shared, not copied
        self._policy = policy
        self._backlog = backlog
        self._fleet = fleet
        self._weighted_levels = [(c.level, c.weight) for c in classes if not c.strict]
        self._admission_wait = [
            c.admission_wait_s if c.admission_wait_s is not None else c.queue_timeout_s
            for c in classes
        ]
        self._predicted: list[tuple[float, float | None] | None] = [None] * len(classes)
        self._rate_at = (-math.inf, 0.0)
        self.completions = DecayingRate()
        self.busy = BusyRate()
        # first dispatches per class and their cost (fair-share units): the service a
        # backlogged class actually gets, after the strict classes, the other shares and aging
        # took theirs, and its weighted share of the service (what admission predicts from)
        self._served = [ServedRate() for _ in classes]
        self._budgets = [c.ttft_budget_ms / 1000.0 for c in classes]
        # the TTFT forecast's parts: the first token's service time after dispatch, and how
        # wrong past forecasts were (``core.forecast``); the room kept for refused requests'
        # returns (``core.bookings``)
        self.first_token = FirstTokenTime()
        # ... and per model: where models differ in speed, one model's first tokens say
        # nothing of another's (a heavy model's slow prefill would make the light model's
        # realtime look infeasible), so once more than one model was served each is forecast
        # from its own (``_service``)
        self._model_first: dict[str, FirstTokenTime] = {}
        self.calibration = Calibration(len(classes), cfg.admission.quantile)
        self.bookings = Bookings(len(classes))
        # dispatch to end of a completed request, decayed: with what is in flight, the rate the
        # fleet completes requests at (Little's law) before the completions counted say so
        self._service_s = 0.0
        # strict requests admitted per second, and their cost: what the weighted classes will
        # not get
        self._strict_in = ServedRate()
        # the other gateway instances of the fleet (shared state), if any
        self.peers: PeerLoad | None = None

    # ---------------------------------------------------------------- what it learns from
    def served(self, req: Request, now: float) -> None:
        """``req`` was sent to an engine for the first time (not a resume). Only a class-aware
        policy's admission reads the served rates: the scheduler tells it only then."""
        self._served[req.class_level].add_served(now, req.cost)

    def first_token_seen(self, req: Request, first: float) -> None:
        """``req``'s first token came at ``first``: the service time it took after dispatch,
        and, if admission forecast its TTFT, how far off that was."""
        dispatched = req.dispatched_at
        if dispatched is not None:
            tokens, took = max(0, req.prompt_tokens - req.cached_tokens), first - dispatched
            self.first_token.add(tokens, took)
            if req.model:
                per_model = self._model_first.get(req.model)
                if per_model is None:
                    per_model = self._model_first[req.model] = FirstTokenTime()
                per_model.add(tokens, took)
        if req.forecast:
            level = req.class_level
            self.calibration.add(level, first - req.arrival, req.forecast, self._budgets[level])

    def unanswered(self, req: Request, now: float) -> None:
        """``req`` ended without a first token (timed out, cancelled, failed): past its
        budget, its forecast was wrong by at least the time it waited."""
        level = req.class_level
        budget = self._budgets[level]
        if req.forecast and now - req.arrival > budget:
            self.calibration.add(level, now - req.arrival, req.forecast, budget)

    def completed(self, req: Request, now: float) -> None:
        """``req`` completed: the completion rate, and the service time Little's law turns
        into a rate before that rate is known."""
        self.completions.add(now)
        self.busy.add(now, self._backlog.total > 0 or self._fleet.free_slots <= 0)
        dispatched = req.dispatched_at
        if dispatched is not None:
            took = now - dispatched
            self._service_s = took if not self._service_s else 0.9 * self._service_s + 0.1 * took

    def calibration_view(self) -> tuple[tuple[str, int, int, float], ...]:
        """Per class with deadline admission: (class, admitted requests whose outcome was seen,
        of those on time, the calibration factor now)."""
        cal = self.calibration
        return tuple((c.name, cal.seen[c.level], cal.met[c.level], cal.factor(c.level))
                     for c in self._classes if c.deadline_admission)

    # ---------------------------------------------------------------- the verdict
    def verdict(self, req: Request, limiter: Limiter, now: float) -> Refusal | Displace | None:
        adm = self.cfg
        over = over_limit(req, adm)
        if over is not None:
            return Refusal(over.reason, None)
        up_models = self._fleet.up_models
        if up_models is not None and (req.model not in up_models if req.model else not up_models):
            # every replica of its model is down: nothing to wait for in the queue (an ejected
            # or cooling one comes back by itself, and its requests wait for it instead)
            return Refusal(Reason.NO_REPLICA_AVAILABLE, self.clamp_retry(0.0))
        refused = limiter.check(req.prompt_tokens + req.est_output_tokens, now)
        if refused is not None:
            reason, wait = refused
            return Refusal(reason, self.clamp_retry(wait or self.slot_wait(now)))
        cls = self._classes[req.level]
        backlog = self._backlog
        if len(backlog.by_class[req.class_level]) >= cls.max_queue:
            return Refusal(Reason.CLASS_QUEUE_FULL, self.clamp_retry(self.slot_wait(now)))
        if cls.deadline_admission and self._policy.class_aware:
            refusal = self._deadline(req, cls, now)
            if refusal is not None:
                return refusal
        if backlog.total:
            refusal = self._overload(req, cls, now)
            if refusal is not None:
                return refusal
        if backlog.total >= adm.max_queue_total:
            victim = backlog.newest_below(req.class_level) if self._policy.class_aware else None
            if victim is None:
                return Refusal(Reason.QUEUE_FULL, self.clamp_retry(self.slot_wait(now)))
            if cls.strict:
                self._strict_in.add_served(now, req.cost)
            return Displace(victim, self.clamp_retry(self.slot_wait(now)))
        if cls.strict:
            self._strict_in.add_served(now, req.cost)
        return None

    def _deadline(self, req: Request, cls: ServiceClass, now: float) -> Refusal | None:
        """Admission against the TTFT budget: refuse now what is forecast to miss it.

        The forecast is the wait in this queue (``_wait``) plus the first token's service time
        (``FirstTokenTime``), times the class's calibration factor (``Calibration``), so that
        an admitted request meets its budget with probability ``admission.quantile``. The room
        kept for refused requests' returns (``Bookings``) counts in the queue ahead, except
        for the request that takes its own booking. Nothing is refused while nothing contends
        (an empty queue, a free slot, no room kept): a long prompt on an idle fleet is served
        late rather than not at all."""
        level = req.class_level
        key = req.retry_key
        bookings = self.bookings
        # a request that takes its booking finds the room kept for it: the others' bookings
        # came after it
        held = 0.0 if key is not None and bookings.take(key, now) else bookings.held(level, now)
        service = self._service(req)
        if not (self._backlog.total or held or self._fleet.free_slots <= 0):
            req.forecast = service
            return None
        budget = req.deadline - now
        factor = self.calibration.factor(level)
        head = next(iter(self._backlog.by_class[level].values()), None)
        # the oldest of its class still queued is this much later than it was forecast: the
        # queue runs that far behind its forecasts now, before any late answer says so (those
        # come a TTFT later)
        late = 0.0
        if head is not None and head.forecast:
            late = max(0.0, now - head.arrival + service - head.forecast)
        est = self._wait(req.level, now, held, cost=req.cost)
        if (est is not None and factor * (est[0] + service) + late > budget
                and self._policy.tenant_fair):
            # its tenant's turn (VTC), not the class's whole queue; and the class's late head
            # may be another tenant's, whose backlog this one does not wait behind
            est = self._wait(req.level, now, held, req.tenant, level, req.cost)
            late = 0.0
        wait, interval = est if est is not None else (0.0, 0.0)
        forecast = wait + service
        if factor * forecast + late <= budget:
            req.forecast = forecast
            return None
        # room for it comes when the wait ahead has drained to what its budget allows
        excess = forecast - (budget - late) / factor
        return Refusal(Reason.DEADLINE_INFEASIBLE, self._retry(req, cls, now, excess, interval))

    def _service(self, req: Request) -> float:
        """``req``'s forecast first-token time after dispatch: from its own model's first
        tokens once more than one model was served (one model's are then the fleet's: a fleet
        of one model forecasts as it always did), else from the fleet's."""
        learned = self.first_token
        if len(self._model_first) > 1:
            learned = self._model_first.get(req.model, learned)
        return learned.seconds(req.prompt_tokens)

    def _retry(self, req: Request, cls: ServiceClass, now: float, excess: float,
               interval: float) -> float:
        """The Retry-After of a request refused ``excess`` seconds too early, its class's
        queue draining one request per ``interval``: booked for its return if it can be told
        apart then, within its class's horizon; else that time, at most the horizon."""
        adm = self.cfg
        horizon = min(adm.max_retry_after_s, max(adm.min_retry_after_s, cls.ttft_budget_ms / 1000))
        earliest = now + max(adm.min_retry_after_s, excess)
        key = req.retry_key
        if key is not None and adm.book_retries:
            due = self.bookings.book(key, req.class_level, now, earliest, interval, horizon,
                                     grace=1.0 + 0.25 * (earliest - now))
            if due is not None:
                return due - now
            return horizon
        return min(horizon, earliest - now)

    def _overload(self, req: Request, cls: ServiceClass, now: float) -> Refusal | None:
        """Honest overload: refuse now what would wait past what its class promises to queue
        it (its ``admission_wait_s``, by default its queue timeout), with the time after which
        the queue ahead is predicted to have drained enough."""
        level = req.level
        tenant_fair = self._policy.tenant_fair
        # a queue-timeout promise is tens of seconds: a reading up to _PREDICT_EVERY_S old
        # will do, and spares every admission the computation
        hit = self._predicted[level]
        if hit is not None and 0 <= now - hit[0] < _PREDICT_EVERY_S:
            predicted = hit[1]
        else:
            predicted = self.predicted_wait(level, now, cost=req.cost)
            self._predicted[level] = (now, predicted)
        limit = self._admission_wait[level]
        if predicted is not None and predicted > limit and tenant_fair:
            # the class as a whole would wait too long: does this tenant's turn?
            predicted = self.predicted_wait(level, now, req.tenant, req.class_level, req.cost)
        if predicted is not None and predicted > limit:
            return Refusal(Reason.OVERLOADED, self.clamp_retry(predicted - limit))
        return None

    # ---------------------------------------------------------------- predictions
    def predicted_wait(
        self, level: int, now: float, tenant: str | None = None, class_level: int | None = None,
        cost: float | None = None,
    ) -> float | None:
        """Seconds a new request of ``level`` is expected to wait before dispatch (``_wait``)."""
        est = self._wait(level, now, 0, tenant, class_level, cost)
        return None if est is None else est[0]

    def _wait(
        self, level: int, now: float, held: float, tenant: str | None = None,
        class_level: int | None = None, cost: float | None = None,
    ) -> tuple[float, float] | None:
        """(wait, interval): seconds a new request of ``level`` is expected to wait before
        dispatch, and seconds between two dispatches of its class at the rate that wait
        assumes; None while no rate is known. From the queue ahead of it, ``held`` more of its
        class (the room kept for refused requests' returns), the slots it could take (free
        ones, and for a class that may preempt, those held by preemptible less urgent requests)
        and the completion rate. With ``tenant`` (under a policy fair between tenants) only the
        tenant's share of its class's queue counts as ahead of it: each backlogged tenant gets a
        turn (VTC), so a flooder's backlog does not delay a light tenant. ``cost``: the
        arriving request's, for a class with no recent dispatches to take its mean from.

        With other gateway instances in front of the fleet (``peers``), their queues count
        ahead too and their completions in the rate: the forecast is the fleet's, so every
        instance admits alike."""
        backlog = self._backlog
        queued = backlog.by_class
        cls = self._classes[level]
        policy = self._policy
        peers = self.peers
        weights = 0.0
        own = 0.0
        if not policy.class_aware:
            ahead = float(backlog.total + held)
        elif cls.strict:
            ahead = float(sum(len(queued[lv]) for lv in backlog.strict_levels if lv <= level)
                          + held)
            if peers is not None:
                ahead += sum(peers.queued(lv) for lv in backlog.strict_levels if lv <= level)
        else:
            strict_ahead = sum(len(queued[lv]) for lv in backlog.strict_levels)
            own = float(len(queued[level]))
            if tenant is not None and policy.tenant_fair:
                tq = backlog.by_tenant[level if class_level is None else class_level]
                mine = tq.get(tenant, 0)
                turns = len(tq) + (0 if mine else 1)
                own = min(own, (mine + 1) * turns)
            own += held
            if peers is not None:
                strict_ahead += sum(peers.queued(lv) for lv in backlog.strict_levels)
                own += peers.queued(level)
            weights = 0.0 if own else cls.weight
            for lv, w in self._weighted_levels:
                if queued[lv] or (lv == level and own):
                    weights += w
            ahead = strict_ahead + own * weights / cls.weight
        room = self._fleet.free_slots
        if cls.can_preempt and policy.preemptive:
            # a slot held by a less urgent preemptible request is as good as free for this one
            room += self._fleet.preemptible_below(level)
        rate = self._rate(now)
        local = rate
        if peers is not None:
            rate += peers.rate()
        interval = 1.0 / rate if rate > 0 else 0.0
        if ahead < room:
            wait = 0.0
        else:
            if rate <= 0:
                return None
            wait = (ahead + 1 - room) / rate
        if policy.class_aware and not cls.strict and own:
            # backlogged: the class is served at the rate it has been getting, which counts what
            # overtakes it while it waits (strict arrivals, the other shares, the prefill
            # budget), and the estimate above, from the queue as it stands now, does not. A
            # backlog next to free room means the room is not the class's to use (the prefill
            # budget or the TPOT guard holds it): there too the served rate is what it gets.
            # But never less than its weighted share of what the non-strict classes were
            # served together: a class served less was held by a rule or had no traffic a
            # moment ago, not refused by a saturated engine, and the shares give it that much
            served = self._served[level].value(now)
            if self._fleet.one_pool:  # (every replica serves the same models: shared slots)
                served = max(served, self._share_rate(level, weights, now, cost))
                # and never more than its weighted share of what the strict classes, admitted
                # at the rate they now are, leave of the fleet's capacity (once measured): what
                # it was served a moment ago does not say that a surge of strict work has
                # since taken its turns
                if self.busy.value() > 0 and backlog.strict_levels:
                    left = self._left_by_strict(level, weights, now, cost)
                    if left is not None:
                        if left <= 0:
                            return math.inf, interval
                        served = min(served, left)
            if served > 0:
                if peers is not None and local > 0:
                    served *= rate / local  # the fleet's service of the class, not this one's
                wait = max(wait, (own + 1) / served)
                interval = max(interval, 1.0 / served)
        return wait, interval

    def _left_by_strict(self, level: int, weights: float, now: float,
                        cost: float | None) -> float | None:
        """Requests per second class ``level`` gets by its weight out of what the strict
        classes, admitted at the rate they now are, leave of the fleet's capacity (requests
        per second while saturated, times the mean cost of what it served); None when nothing
        is known."""
        served = self._served
        count = sum(r.value(now) for r in served)
        if count <= 0:
            return None
        capacity = self.busy.value() * sum(r.cost_value(now) for r in served) / count
        rate = served[level]
        n, spent = rate.value(now), rate.cost_value(now)
        mean = spent / n if n > 0 else cost
        if not mean:
            return None
        left = capacity - self._strict_in.cost_value(now)
        return left * self._classes[level].weight / weights / mean

    def _share_rate(self, level: int, weights: float, now: float, cost: float | None) -> float:
        """Requests per second class ``level`` gets by its weight out of the service (in cost)
        the non-strict classes got together, ``weights`` being the backlogged classes' weights;
        its requests' cost is its own recent mean (or ``cost``, before it has one). 0 when
        nothing is known."""
        together = sum(self._served[lv].cost_value(now) for lv, _ in self._weighted_levels)
        if together <= 0:
            return 0.0
        rate = self._served[level]
        served, served_cost = rate.value(now), rate.cost_value(now)
        mean = served_cost / served if served > 0 else cost
        if not mean:
            return 0.0
        return together * self._classes[level].weight / weights / mean

    def _rate(self, now: float) -> float:
        """The fleet's completion rate while saturated (``BusyRate``), re-read at most every
        ``_RATE_EVERY_S``: it moves slowly, and every admission under a queue asks for it."""
        at, value = self._rate_at
        if now - at >= _RATE_EVERY_S or now < at:
            value = self.busy.value()
            if not value:
                # before the fleet has been seen saturated for long: the decayed completion
                # rate, and never below what is in flight completes at the measured service
                # time (Little's law): a gateway that has seen little traffic counted the
                # completions of what it was sent, not of what the engines can do, and a queue
                # forms only once the windows are full
                value = self.completions.value(now)
                if self._service_s > 0:
                    inflight = sum(len(r.inflight) for r in self._fleet.usable)
                    value = max(value, inflight / self._service_s)
            self._rate_at = (now, value)
        return value

    def local_rate(self, now: float) -> float:
        """This instance's completion rate as its forecasts read it (without the others')."""
        return self._rate(now)

    def slot_wait(self, now: float) -> float:
        """Seconds until a slot frees, at the recent completion rate (0: unknown)."""
        rate = self._rate(now)
        return 1.0 / rate if rate > 0 else 0.0

    def clamp_retry(self, seconds: float) -> float:
        """A Retry-After within the configured bounds."""
        adm = self.cfg
        return min(adm.max_retry_after_s, max(adm.min_retry_after_s, seconds))
