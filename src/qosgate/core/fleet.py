"""The fleet: the replicas, their free room, and the placement rules between classes.

It answers the scheduler's placement queries -- which replica a request goes to
(``choose``), whether a replica may take it (``may_take``), whether anything queued may go at
all (``nothing_may_go``), where a request may overtake unstarted work (``overtake_target``),
which request to pull back for a more urgent one (``preemption_victim``) -- and keeps each
replica's books as the scheduler places and releases requests (``place``, ``release``,
``started``). It never changes a request's state, nor calls the scheduler back.

The rules between classes live here because they are questions about a replica's room: the
reserved share of each window for the classes above (replica-level isolation, lent only to a
class that can give it back), the prefill budget and the strict-prompt hold (the strict
classes' streams and prompts first), the TPOT guard (an engine whose time per token slows
past it holds the other classes off), and, where a window counts cost (``core.slot_costs``), the
room a costlier request keeps until it fits (``hold_room``). The docstrings say why each is
shaped as it is.

Longer than most modules (about 750 lines): the isolation rules and the room they leave are one
set of counters read together; split, each half would need the other's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from qosgate.config import QosConfig, ServiceClass
from qosgate.core.backlog import Backlog
from qosgate.core.breakers import build_breaker
from qosgate.core.facts import AttemptFailed
from qosgate.core.replica import BUDGET_OPEN, Replica, ReplicaSpec
from qosgate.core.request import DISPATCHED, LENT_PREEMPTIBLE, LENT_STREAMING, Request
from qosgate.core.routing import Router, RouterContext, build_router
from qosgate.core.signals import LoadSignals
from qosgate.core.slot_costs import in_slots, slot_costs
from qosgate.core.snapshot import ReplicaView
from qosgate.core.tpot_guard import build_guard
from qosgate.core.weights import ModelWeights
from qosgate.core.windows import FixedWindow, WindowRule, build_window


def reserved_slots(share: float, window: int) -> int:
    """The slots a reserved ``share`` of a ``window`` keeps: its whole part, but never none
    for a positive share (a tenth of 8 slots is one slot, not zero) and never the whole
    window (a one-slot engine keeps none: the classes below would never run)."""
    if share <= 0 or window < 2:
        return 0
    return min(window - 1, max(1, int(share * window)))


class Fleet:
    def __init__(self, cfg: QosConfig, classes: Sequence[ServiceClass], class_aware: bool,
                 ceiling: int, backlog: Backlog, router: Router | None = None,
                 weights: ModelWeights | None = None) -> None:
        """``ceiling``: the level aging stops at; ``weights``: the models' weights, which size
        the slot a request holds on a replica serving several (``core.slot_costs``)."""
        self.cfg = cfg
        self.weights = weights
        self._backlog = backlog
        # each base model's LoRA adapters (``models[].base``): a replica serving the base
        # serves them too
        self.adapters_of: dict[str, frozenset[str]] = {}
        for m in cfg.models:
            if m.base is not None:
                self.adapters_of[m.base] = self.adapters_of.get(m.base, frozenset()) | {m.name}
        self.replicas: dict[str, Replica] = {}
        self.strict = [c.strict for c in classes]
        # share of each window kept for the classes above a band (replica-level isolation), and
        # whether a class may borrow it while idle (it can give it back: it is preemptible)
        self.reserve_above = [
            sum(c.reserved_share for c in classes if c.level < lvl) for lvl in range(len(classes))
        ]
        self.may_borrow = [c.preemptible for c in classes]
        # the classes no reserve holds back (the ones a reserve is kept for, at the top)
        self._reserve_levels = [c.level for c in classes if not self.reserve_above[c.level]]
        # whether a class's streams may be evicted after their first byte and resumed
        self.resume = [c.resume for c in classes]
        self._min_run_s = cfg.preemption.min_run_s
        self._max_evictions = cfg.preemption.max_evictions
        # the largest share of a window a class may not use (kept for the classes above it)
        self._reserve_max = max(
            (f for f, borrow in zip(self.reserve_above, self.may_borrow, strict=True)
             if not borrow), default=0.0)
        # the classes a reserve holds back that may not borrow it: while one of theirs waits,
        # the reserve is lent to no one (see _reserve_allows)
        self._unlent_levels = [
            c.level for c in classes if self.reserve_above[c.level] and not c.preemptible]
        # the smallest reserve any queued non-strict request can face (aging stops at the
        # ceiling), for the test that nothing queued may go
        self._reserve_floor = min(
            (self.reserve_above[min(c.level, ceiling)] for c in classes if not c.strict),
            default=0.0)
        # the prefill budget protects the strict classes' streams: a policy blind to classes
        # (fifo, the baseline) has none to protect
        self.prefill_budget = cfg.fleet.prefill_budget_tokens if class_aware else None
        # each strict class's TPOT budget (None for the others), which the TPOT guard and the
        # spreading router protect; the guard holds a replica past the tightest one times its
        # fraction
        self.tpot_budget_s = [
            c.tpot_budget_ms / 1000.0 if c.strict and c.tpot_budget_ms else None for c in classes
        ]
        strict_tpot_s: Mapping[int, float] = {
            lvl: b for lvl, b in enumerate(self.tpot_budget_s) if b is not None}
        self.guard_mode = cfg.fleet.tpot_guard if strict_tpot_s and class_aware else None
        self._guard_budget_s = min(strict_tpot_s.values(), default=0.0)
        self.hold_others = self.prefill_budget is not None or self.guard_mode is not None
        # a strict prompt waiting on a replica holds the other classes' requests from it
        self.prompt_hold = cfg.fleet.strict_prompt_hold and class_aware
        # replicas whose prefill budget this fill closed to the classes below a held prompt
        self.budget_closed: list[Replica] = []
        # replicas whose room this fill keeps for a request costlier than it (``hold_room``)
        self.room_held: list[Replica] = []
        # whether a rule may keep free room from the queue (the reserve, the prefill budget,
        # the TPOT guard): only then can a fill find nothing to dispatch beside free slots
        self.may_stall = self.hold_others or self.prompt_hold or any(self.reserve_above)
        if router is None:
            cache = cfg.fleet.cache
            router = build_router(cfg.fleet.router, RouterContext(
                strict_tpot_s=strict_tpot_s,
                strict_ttft_s={c.level: c.ttft_budget_ms / 1000.0 for c in classes if c.strict},
                # a class may wait for a warm replica where the bound is small beside its TTFT
                may_wait_levels=frozenset(
                    c.level for c in classes
                    if not c.strict and c.ttft_budget_ms / 1000.0 >= 10 * cache.warm_wait_s),
                cache=cache))
        self.router: Router = router
        # replicas that may take work now; free_slots counts only their room
        self.usable: list[Replica] = []
        self.usable_names: set[str] = set()
        # a usable replica's engine runs its queue in our order (only then may a request
        # overtake: the scheduler asks nothing more of the fleet on a submit without one)
        self.ordered_usable = False
        self._any_model = True  # every usable replica serves every model: no model filter
        self.costed = False  # a usable replica counts its window in cost (``core.slot_costs``)
        self.one_pool = True  # every usable replica serves the same models: classes share slots
        # models some up replica serves (None: one serves any model, or there is no replica)
        self.up_models: frozenset[str] | None = None
        self.next_change = math.inf  # when a cooling or an ejection ends
        self.free_slots = 0
        # requests in flight that may still be pulled back (preemption victims)
        self.preemptible: dict[str, Request] = {}
        # streams in flight that may be evicted and resumed elsewhere (classes with resume),
        # and when the first one the last search found too fresh may be (its minimum run done)
        self.evictable: dict[str, Request] = {}
        self.victim_at = math.inf

    # ---------------------------------------------------------------- replicas
    def add(self, spec: ReplicaSpec, window_rule: WindowRule | None = None) -> None:
        if spec.name in self.replicas:
            raise ValueError(f"replica {spec.name!r} exists")
        fleet = self.cfg.fleet
        breaker = build_breaker(fleet.outlier, fleet.seed + len(self.replicas))
        if window_rule is None:
            # a pausable (in-process) engine is scheduled here token by token: its window is
            # its batch unless asked otherwise
            mode = spec.window_mode or ("fixed" if spec.pausable else fleet.window.mode)
            window_rule = build_window(mode, spec.max_window, fleet.window)
        guard_mode = self.guard_mode
        self.replicas[spec.name] = Replica(
            spec.name, window_rule, models=sorted(self.with_adapters(spec.models)),
            pausable=spec.pausable, breaker=breaker,
            up=spec.up, guard=None if guard_mode is None else build_guard(guard_mode),
            ordered=spec.ordered, resumes=spec.resumes,
        )
        if spec.cache_events:
            self.router.follow_events(spec.name)
        self.refresh(-math.inf)

    def with_adapters(self, models: Sequence[str]) -> frozenset[str]:
        """``models`` and the configured adapters of each (none listed: any model, still)."""
        served = frozenset(models)
        for m in models:
            served |= self.adapters_of.get(m, frozenset())
        return served

    def reweigh(self, weights: ModelWeights, now: float) -> None:
        """The models' weights changed (a reload): the slots of what is placed from now on."""
        self.weights = weights
        self.refresh(now)

    def retire(self, name: str, now: float) -> None:
        """``name`` left the config (a reload): it takes no new work, its in-flight requests
        finish there, and its probes are no longer heard."""
        rep = self.replicas[name]
        rep.retired = True
        rep.up = False
        self.router.cache_lost(name, now)
        self.refresh(now)

    def set_window(self, name: str, window: int) -> None:
        rep = self.replicas[name]
        if not isinstance(rep.window_rule, FixedWindow):
            raise TypeError(f"replica {name!r} has an adaptive window")
        rep.window_rule.set(window)

    def observe(self, rep: Replica, now: float, up: bool | None,
                models: Sequence[str] | None, signals: LoadSignals | None) -> None:
        """What a health probe or a metrics scrape found out about ``rep``."""
        if rep.retired:
            return
        if (up is False and rep.up) or (
                signals is not None and rep.signals is not None
                and _restarted(rep.signals, signals)):
            self.router.cache_lost(rep.name, now)  # down, or a new engine behind it: empty
            rep.adapters.forget()
        if up is not None:
            rep.up = up
        if models is not None:
            rep.models = self.with_adapters(models)
        if signals is not None:
            rep.signals = signals
            if signals.adapters is not None:
                rep.adapters.observe(signals.adapters, signals.adapter_capacity, signals.at)
            rep.window_rule.on_signals(
                now, in_slots(signals, rep.held, len(rep.inflight)) if rep.costs else signals,
                self._busy(rep))
            self._watch_itl(rep, signals)
            rep.engine_share = signals.share(len(rep.inflight))
        self.refresh(now)

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
        guard = self.guard_s(rep)
        if guard is not None:
            rep.others_held = itl > (0.75 * guard if rep.others_held else guard)

    def guard_s(self, rep: Replica) -> float | None:
        """The inter-token latency past which the TPOT guard holds ``rep`` (None: no guard)."""
        g = rep.guard
        return None if g is None else g.fraction * self._guard_budget_s

    def stream_ended(self, req: Request) -> None:
        """A request completed: a strict stream's TPOT against its budget, for its replica's
        guard."""
        budget = self.tpot_budget_s[req.class_level]
        if budget is None or self.guard_mode is None:
            return  # (the common case: a request of another class, or no guard)
        tpot = req.tpot
        rep = self.replicas.get(req.replica or "")
        if tpot is not None and rep is not None and rep.guard is not None:
            rep.guard.on_stream_ended(tpot / budget)

    def _busy(self, rep: Replica) -> int:
        """What a window counts as in use: the requests in flight and the free room kept for
        the classes above (the reserved share), which the queue may not fill. Without the
        latter a window of 20 or more never counted as full under api traffic and never grew."""
        reserved = reserved_slots(self._reserve_max, rep.window_rule.window)
        return rep.held + (min(reserved, rep.free) if reserved else 0)

    def refresh(self, now: float) -> None:
        """Recount which replicas may take work (and their room) after a change of health,
        cooling, ejection or window."""
        weights = self.weights
        if weights is not None:
            # (a learned weight moves with the scrapes, which end here: recounted with them)
            for r in self.replicas.values():
                if r.costs or len(r.models) > 1:
                    r.costs = slot_costs(r.models, weights)
        usable = [r for r in self.replicas.values() if r.eligible(now)]
        self.usable = usable
        self.usable_names = {r.name for r in usable}
        self.ordered_usable = any(r.ordered for r in usable)
        self._any_model = all(not r.models for r in usable)
        self.one_pool = len({r.models for r in usable}) <= 1
        self.costed = any(r.costs for r in usable)
        up = [r for r in self.replicas.values() if r.up]
        if not self.replicas or any(not r.models for r in up):
            self.up_models = None
        else:
            self.up_models = frozenset(m for r in up for m in r.models)
        self.free_slots = sum(r.free for r in usable)
        nxt = math.inf
        for r in self.replicas.values():
            t = r.next_change()
            if t is not None and now < t < nxt:
                nxt = t
        wake = self.router.wake_at(now)  # a request it holds for a warm replica goes anyway
        self.next_change = wake if wake < nxt else nxt

    def sampled(self, rep: Replica, now: float, latency: float, dropped: bool) -> None:
        """Tell a replica's window how an attempt went; its room changes with it."""
        before = rep.free
        rep.window_rule.on_sample(now, latency, len(rep.inflight), dropped)
        if rep.name in self.usable_names:
            self.free_slots += rep.free - before

    def attempt_failed(self, rep: Replica, now: float, latency: float, fact: AttemptFailed) -> None:
        """An attempt on ``rep`` failed before its first byte (see
        ``Scheduler.attempt_failed``): back-pressure cools it and tells its window; any other
        failure makes it suspect and tells its breaker; a refused connection marks it down."""
        if fact.backpressure:
            wait = fact.retry_after if fact.retry_after is not None else self.cfg.fleet.cooldown_s
            rep.cooled_until = max(rep.cooled_until, now + wait)
            rep.window_rule.on_sample(now, latency, len(rep.inflight), True)
        else:
            rep.failing = True
            rep.breaker.on_result(now, False)
        if fact.unreachable:
            if rep.up:
                self.router.cache_lost(rep.name, now)  # the engine process is gone
                rep.adapters.forget()
            rep.up = False

    def inflight_per_class(self, classes: int) -> list[int]:
        inflight = [0] * classes
        for rep in self.replicas.values():
            for r in rep.inflight.values():
                inflight[r.class_level] += 1
        return inflight

    def views(self, now: float) -> tuple[ReplicaView, ...]:
        return tuple(
            ReplicaView(
                name=r.name,
                models=tuple(sorted(r.models)),
                window=r.window,
                inflight=len(r.inflight),
                up=r.up,
                retired=r.retired,
                eligible=r.name in self.usable_names and r.eligible(now),
                breaker=r.breaker.state(now),
                ejections=r.breaker.ejections,
                cooling_s=max(0.0, r.cooled_until - now),
                signals=r.signals,
                engine_itl_s=r.itl_s,
                others_held=r.others_held and r.strict_streams > 0,
                tpot_guard_s=self.guard_s(r),
                adapters=r.adapters.names(),
            )
            for r in self.replicas.values()
        )

    # ---------------------------------------------------------------- a replica's books
    def place(self, req: Request, rep: Replica, now: float, resume: bool, streaming: bool,
              over: bool) -> bool:
        """``req`` goes to ``rep`` (``resume``: a paused request resumes there, ``streaming``:
        after its first byte; ``over``: past a full window). True if it takes a slot lent from
        the reserve. A request placed anew sets ``req.cached_tokens``: what the router expects
        ``rep``'s prefix cache to hold of its prompt, and counts in ``req.loads`` a LoRA adapter
        that ``rep`` has to load for it."""
        before = rep.free
        rep.inflight[req.id] = req
        cost = rep.cost_of(req.model)
        rep.held += cost
        if cost != 1:
            rep.charged[req.id] = cost
        req.ran_since = now
        if not resume:
            req.cached_tokens = self.router.placed(req, rep, now)
            if req.load_cost:
                if not rep.adapters.holds(req.model):
                    req.loads += 1
                rep.adapters.sent(req.model, now)
        strict = self.strict[req.class_level]
        if not strict:
            rep.others_inflight += 1
        if streaming:
            if strict:
                rep.strict_streams += 1
        else:
            rep.prefill_tokens += req.prompt_tokens
            if not strict:
                rep.other_prefill_tokens += req.prompt_tokens
            rep.pending += 1
        self.free_slots += rep.free - before  # rep is usable: the router sees only those
        lent = False
        if self.may_borrow[req.class_level]:
            frac = self.reserve_above[req.level]
            if frac and not rep.pausable:
                room = self._reserve_room(rep, frac)  # (rep.free counts this dispatch)
                if room is not None and room < 0:  # it found no room beyond: a loan
                    lent = True
                    rep.loans += 1
            if streaming and not rep.pausable:  # a stream continued here (it was evicted)
                if self.may_evict(req, rep):
                    self.evictable[req.id] = req
            else:
                self.preemptible[req.id] = req
                rep.preemptible += cost
        return lent

    def may_evict(self, req: Request, rep: Replica) -> bool:
        """Whether ``req``, streaming on ``rep``, may be evicted and resumed elsewhere: its
        class says so, its answer can continue exactly, the engine continues from token ids,
        and it has evictions left."""
        return (self.resume[req.class_level] and req.resumable and rep.resumes
                and req.evictions < self._max_evictions)

    def unresumable(self, req: Request) -> None:
        """``req``'s answer turned out not to continue exactly (``Request.resumable`` is off):
        it is no longer a victim once it streams."""
        self.evictable.pop(req.id, None)

    def started(self, req: Request, rep: Replica, now: float, first: float) -> bool:
        """``req``'s first byte left ``rep``: it no longer waits for prefill. True if its slot,
        lent from the reserve, now streams (it can no longer give it back)."""
        self.router.started(req, rep)
        rep.prefill_tokens -= req.prompt_tokens
        rep.pending -= 1
        if self.strict[req.class_level]:
            rep.strict_streams += 1
        else:
            rep.other_prefill_tokens -= req.prompt_tokens
        if rep.strict_streams and (self.prefill_budget is not None or self.prompt_hold):
            # prefill budget freed, or the hold for a strict prompt ended: the queue may use
            # it now
            self.next_change = now
        streams_on_loan = False
        if not rep.pausable and self.preemptible.pop(req.id, None) is not None:
            rep.preemptible -= rep.charged.get(req.id, 1)
            if self.may_evict(req, rep):  # it can still give its slot back, by eviction
                self.evictable[req.id] = req
            elif req.lent == LENT_PREEMPTIBLE:  # its slot is on loan until it ends
                streams_on_loan = True
                rep.loan_streams += 1
        if rep.failing:  # a success ends a run of failures (and a probation)
            rep.failing = False
            rep.breaker.on_result(now, True)
            self.next_change = now  # recount the room at the next tick (now)
        if rep.window_rule.adaptive:
            self.sampled(rep, now, first - (req.dispatched_at or first), False)
        return streams_on_loan

    def release(self, req: Request) -> bool:
        """``req`` leaves its replica (or is pulled back): its slot and any loan are returned.
        True if it left unstarted (it held a slot, and had sent no first byte)."""
        rep = self.replicas.get(req.replica or "")
        if self.preemptible.pop(req.id, None) is not None and rep is not None:
            rep.preemptible -= rep.charged.get(req.id, 1)
        elif self.evictable:
            self.evictable.pop(req.id, None)
        if req.lent and rep is not None:  # the loan is repaid: the slot is the reserve's again
            rep.loans -= 1
            if req.lent == LENT_STREAMING:
                rep.loan_streams -= 1
        if rep is None or rep.inflight.pop(req.id, None) is None:
            return False
        before = rep.free
        rep.held -= rep.charged.pop(req.id, 1) if rep.charged else 1
        self.router.left(req, rep)
        strict = self.strict[req.class_level]
        if not strict:
            rep.others_inflight -= 1
        unstarted = req.state is DISPATCHED
        if unstarted:
            rep.prefill_tokens -= req.prompt_tokens
            if not strict:
                rep.other_prefill_tokens -= req.prompt_tokens
            rep.pending -= 1
        elif strict:
            rep.strict_streams -= 1
        if rep.name in self.usable_names:
            self.free_slots += rep.free - before
        return unstarted

    # ---------------------------------------------------------------- placement queries
    def choose(self, req: Request, now: float) -> Replica | None:
        """The replica ``req`` goes to now, or None (it waits)."""
        if req.replica is not None:  # paused: its state lives on that replica
            rep = self.replicas.get(req.replica)
            # it resumes there under that replica's rules (``may_take``: a suspect one takes
            # one unanswered request at a time, the reserve is lent only while api does not
            # wait), else it took the slot past a higher class a rule held
            ok = rep is not None and rep.fits(req.model) and self.may_take(rep, req, now)
            return rep if ok else None
        usable = self.usable
        if not (self._any_model or not req.model):
            model = req.model
            usable = [r for r in usable if r.serves(model)]
        if self.room_held and not self.strict[req.class_level]:
            usable = [r for r in usable if not r.room_held]
        if self.reserve_above[req.level] or (
            self.hold_others and not self.strict[req.class_level]
        ):
            usable = [r for r in usable if self._isolated_ok(r, req, now)]
        if req.avoid is not None:  # a retry: another replica while the model has one
            others = [r for r in usable if r.name != req.avoid]
            if others:
                usable = others
        for suspect in self.usable:  # (a loop, not any(): no generator on every dispatch)
            if suspect.failing:
                usable = [r for r in usable if not (r.failing and r.pending)]
                break
        if len(usable) == 1:  # nothing to choose between
            only = usable[0]
            rep = only if only.fits(req.model) else None
        else:
            rep = self.router.pick(req, usable, now)
            if rep is None:  # held for a warm replica: placed anyway by this time
                wake = self.router.wake_at(now)
                if wake < self.next_change:
                    self.next_change = wake
        if (self.prompt_hold and rep is not None and not self.strict[req.class_level]
                and _strict_prompt_waits(rep)):
            # held here, not sent elsewhere: as a filter before the router (sending them to
            # the replicas with no realtime prompt) it cost fleet-faults and fleet-mixed more
            # (docs/experiments/tpot-guard.md)
            return None
        return rep

    def may_take(self, rep: Replica, req: Request, now: float) -> bool:
        """Whether ``rep`` may take ``req`` now, room aside: it may take work, serves the
        model, keeps its reserved share for the classes above, and (while it streams to a
        strict class) keeps the prefill it has not answered within the budget."""
        if rep.name not in self.usable_names or not rep.serves(req.model):
            return False
        if req.replica is not None and req.replica != rep.name:
            return False  # paused: its state lives on that replica
        if req.avoid == rep.name and any(
            r is not rep and r.serves(req.model) for r in self.usable
        ):
            return False  # a retry waits for another replica while the model has one
        if rep.failing and rep.pending:
            return False  # suspect: one unanswered request at a time
        if rep.room_held and not self.strict[req.class_level]:
            return False  # kept for a costlier request before it in order (``hold_room``)
        if (self.prompt_hold and req.replica is None and not self.strict[req.class_level]
                and _strict_prompt_waits(rep)):
            return False
        return self._isolated_ok(rep, req, now)

    def overtake_target(self, req: Request, order: int, now: float) -> Replica | None:
        """Every window is full: the ordered engine where ``req`` (engine order ``order``)
        would overtake the most of this gateway's unstarted requests, past its full window by
        at most that many (so the engine's queue grows by no more than it already held)."""
        best: Replica | None = None
        most = 0
        for rep in self.usable:
            if not (rep.ordered and rep.pending):
                continue
            over = max(0, rep.held - rep.window)
            if rep.pending - over <= most or not self.may_take(rep, req, now):
                continue  # (it could overtake no more than its unstarted requests)
            later = sum(1 for r in rep.inflight.values()
                        if r.state is DISPATCHED and r.order is not None and r.order > order)
            room = later - over
            if room > most:
                best, most = rep, room
        return best

    def may_overtake(self) -> bool:
        """Some usable ordered engine holds unstarted requests of ours."""
        return any(r.ordered and r.pending for r in self.usable)

    def preemption_victim(self, req: Request, now: float) -> Request | None:
        """The request whose slot ``req`` takes, or None: of the preemptible requests of a
        class below ``req``'s, the least urgent; among those, one that has sent nothing yet
        before a stream (nothing to recompute), then the most recently dispatched. A stream is
        a victim only once it has run ``preemption.min_run_s`` since it (re)started."""
        victim: Request | None = None
        best = (0, False, 0.0)
        for cand in self.preemptible.values():
            if cand.level <= req.level:
                continue
            if req.model and not self.replicas[cand.replica or ""].serves(req.model):
                continue  # its slot would be of no use to req
            key = (cand.level, True, cand.dispatched_at or 0.0)
            if victim is None or key > best:
                victim, best = cand, key
        self.victim_at = math.inf
        if self.evictable:
            settled = now - self._min_run_s
            for cand in self.evictable.values():
                if cand.class_level <= req.class_level or cand.level <= req.level:
                    continue
                if cand.ran_since > settled:
                    at = cand.ran_since + self._min_run_s
                    if at < self.victim_at:
                        self.victim_at = at
                    continue
                if req.model and not self.replicas[cand.replica or ""].serves(req.model):
                    continue
                key = (cand.level, False, cand.ran_since)
                if victim is None or key > best:
                    victim, best = cand, key
        return victim

    def reserve_waits(self) -> bool:
        """A request a reserve is kept for waits (of a class no reserve holds back): a fill
        that set many aside must go on to it while a reserved slot is free, whatever order
        the policy pops in (under ``wfq`` a realtime request may come after many others)."""
        if not self._reserve_max:
            return False
        queued = self._backlog.by_class
        return any(queued[lv] for lv in self._reserve_levels)

    def preemptible_below(self, level: int) -> int:
        """Slots held by requests less urgent than ``level`` that it may pull back now
        (evictable streams included, whatever their run time: they come back soon)."""
        n = sum(1 for r in self.preemptible.values() if r.level > level)
        if self.evictable:
            n += sum(1 for r in self.evictable.values() if r.level > level)
        return n

    # ---------------------------------------------------------------- isolation between classes
    def reopen_budgets(self) -> None:
        """A fill begins: the last fill's prefill-budget closures and held room no longer
        hold."""
        for closed in self.budget_closed:
            closed.budget_closed_below = BUDGET_OPEN
        self.budget_closed.clear()
        for held in self.room_held:
            held.room_held = False
        self.room_held.clear()

    def hold_room(self, req: Request) -> None:
        """``req`` found no replica: on each replica of its model whose window counts cost and
        has some room, but less than ``req``'s slots, that room is kept from every request
        after it in this fill (the fill pops in the policy's order) but the strict classes'
        (they have their reserve). So the room adds up until ``req`` fits; else lighter
        requests behind it would take each slot as it frees, and a heavy request would wait
        for as long as they kept coming."""
        frac = self.reserve_above[req.level]
        for rep in self.usable:
            if not rep.costs or rep.room_held or not rep.serves(req.model) or (
                    req.replica not in (None, rep.name)):
                continue
            room = self._reserve_room(rep, frac) if frac else None
            free = rep.free if room is None else min(rep.free, room)
            if 0 < free < rep.cost_of(req.model):
                rep.room_held = True
                self.room_held.append(rep)

    def close_budget_below(self, req: Request) -> None:
        """``req`` (of a non-strict class) found no replica: where the prefill budget is what
        kept it out, close that replica's budget to the classes below it for this fill."""
        budget = self.prefill_budget
        if budget is None or self.strict[req.class_level]:
            return
        level = req.class_level
        for rep in self.usable:
            if (rep.strict_streams and rep.free > 0 and level < rep.budget_closed_below
                    and rep.serves(req.model) and req.replica in (None, rep.name)
                    and not _fits_budget(rep, req, budget)):
                rep.budget_closed_below = level
                self.budget_closed.append(rep)

    def nothing_may_go(self) -> bool:
        """No strict or paused request is queued and every replica with room keeps it from the
        other classes (it is the reserve, or the prefill budget is spent on their prompts, or
        the TPOT guard is on): no queued request may go anywhere. Conservative: True only
        where ``may_take`` would refuse every queued request."""
        budget = self.prefill_budget
        floor = self._reserve_floor
        lend: bool | None = None  # whether the reserve may be lent now (asked once, if at all)
        for rep in self.usable:
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
                    self.prompt_hold and _strict_prompt_waits(rep)):
                return False  # the common case, and the cheapest test first
        backlog = self._backlog
        return not backlog.paused and not backlog.strict_waits()

    def lending_withheld(self) -> bool:
        """The reserve is lent to no one now, because a class that may not borrow it waits."""
        return bool(self._unlent_levels) and not self._may_lend()

    def _may_lend(self) -> bool:
        """Whether the reserve may be lent now: no class that may not borrow it waits (lent
        then, the slot would go to a lower class while a higher one, which may not use it,
        waits; and on an engine that cannot pause it stays lent for the borrower's stream)."""
        queued = self._backlog.by_class
        return not any(queued[lv] for lv in self._unlent_levels)

    def _reserve_room(self, rep: Replica, frac: float) -> int | None:
        """Slots of ``rep`` beyond a reserve of ``frac`` of its window (None: no reserve): its
        free ones less the reserve, plus the reserve's slots on loan (each returns to it when
        its borrower ends: the borrower's debt, not the other classes'). On an engine that
        pauses, every request of a class that may be pulled back counts as free room too: the
        classes above can have its slot back at any time."""
        reserved = reserved_slots(frac, rep.window_rule.window)
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
        frac = self.reserve_above[req.level]
        if not frac:
            return True
        room = self._reserve_room(rep, frac)
        if room is None:
            return True
        cost = rep.cost_of(req.model)
        if room >= cost:
            return True
        # (a loan is one slot: a request costlier than that is never lent the reserve)
        return (room == 0 and cost == 1 and rep.free >= 1 and not rep.loan_streams
                and self.may_borrow[req.class_level] and self._may_lend())

    def _isolated_ok(self, rep: Replica, req: Request, now: float) -> bool:
        if not self._reserve_allows(rep, req):
            return False
        if not rep.strict_streams or req.replica is not None or self.strict[req.class_level]:
            return True
        if rep.others_held:
            if rep.others_inflight:
                # its streams are slow: realtime's time per token comes first; but one request
                # of the others at a time still goes (no starvation where realtime alone is slow)
                return False
        else:
            guard = self.guard_s(rep)
            if guard is not None and (rep.itl_s is None or rep.itl_s > 0.75 * guard) and any(
                    r.others_held for r in self.usable):
                # what a held replica does not take must not pile onto one close to its own
                # guard (without this, on fleet-mixed the H100s took what the slower A100s were
                # held off, and evicted from their KV caches: see docs/experiments/tpot-guard.md)
                return False
        budget = self.prefill_budget
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
        return _fits_budget(rep, req, budget)


def _restarted(seen: LoadSignals, now: LoadSignals) -> bool:
    """A counter the engine keeps since it started went down: a new engine answers now."""
    for before, after in ((seen.preemptions_total, now.preemptions_total),
                          (seen.itl_tokens_total, now.itl_tokens_total)):
        if before is not None and after is not None and after < before:
            return True
    return False


def _fits_budget(rep: Replica, req: Request, budget: int) -> bool:
    return (rep.other_prefill_tokens == 0
            or rep.prefill_tokens + req.prompt_tokens <= budget * rep.engine_share)


def _strict_prompt_waits(rep: Replica) -> bool:
    """A strict request's prompt was sent to ``rep`` and not answered yet (every prompt
    counts at least one token, so the strict classes' share of the pending tokens says it).
    The engine would fill that prompt's step with whatever else waits (vLLM fills each
    step's token budget): the other classes' prompts sent now would share realtime's
    prefill steps and lengthen them, the cost to realtime's TTFT that realtime alone does
    not pay."""
    return rep.prefill_tokens > rep.other_prefill_tokens
