"""The request as the scheduler sees it, and its life as a state machine.

Every accepted request ends in exactly one terminal state with a reason; the transition table is
the single place that says which moves are legal, so a bug that would count a request twice
fails loudly.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from qosgate.core.prefix import Prefix


class State(StrEnum):
    NEW = "new"
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    RUNNING = "running"
    PREEMPTED = "preempted"
    COMPLETED = "completed"
    REJECTED = "rejected"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL


# Module-level aliases: in Python 3.11 every ``State.X`` is an ~80 ns metaclass lookup, and the
# scheduler's hot path names states a few dozen times per request.
NEW, QUEUED, DISPATCHED, RUNNING, PREEMPTED = (
    State.NEW,
    State.QUEUED,
    State.DISPATCHED,
    State.RUNNING,
    State.PREEMPTED,
)
COMPLETED, REJECTED, TIMED_OUT, CANCELLED, FAILED = (
    State.COMPLETED,
    State.REJECTED,
    State.TIMED_OUT,
    State.CANCELLED,
    State.FAILED,
)

TERMINAL = frozenset(
    {State.COMPLETED, State.REJECTED, State.TIMED_OUT, State.CANCELLED, State.FAILED}
)

# The request's life: every legal move, each state to the states it may go to next. ``move``
# refuses any other; tests/core/test_states.py drives the scheduler through every one, and
# scripts/state_diagram.py draws the guide's state diagram from it.
TRANSITIONS: dict[State, frozenset[State]] = {
    State.NEW: frozenset({State.QUEUED, State.REJECTED}),
    State.QUEUED: frozenset({State.DISPATCHED, State.REJECTED, State.TIMED_OUT, State.CANCELLED}),
    State.DISPATCHED: frozenset(
        {
            State.QUEUED,  # its attempt failed before the first byte: re-queued for a retry
            State.REJECTED,  # the engine refused the request itself (a 4xx)
            State.RUNNING,
            State.PREEMPTED,
            State.COMPLETED,
            State.CANCELLED,
            State.TIMED_OUT,
            State.FAILED,
        }
    ),
    State.RUNNING: frozenset(
        {State.PREEMPTED, State.COMPLETED, State.CANCELLED, State.TIMED_OUT, State.FAILED}
    ),
    # pulled back for a more urgent request, or (a stream that can continue elsewhere) off a
    # replica that failed mid-stream: queued again
    State.PREEMPTED: frozenset({State.QUEUED}),
}
# a terminal state goes nowhere: every state has its row, so ``move`` needs no default
TRANSITIONS.update({s: frozenset() for s in TERMINAL})


class Releasable(Protocol):
    def release(self, token: object) -> None: ...


class IllegalTransition(RuntimeError):
    pass


NOT_LENT, LENT_PREEMPTIBLE, LENT_STREAMING = 0, 1, 2
_INF = math.inf  # (a module global: one lookup, not two, in the constructor)


class Request:
    """One inference request.

    ``first_token_at`` is when the first byte reached the client (the line after which it is
    never retried, nor preempted by abort). ``level`` is the queue band the request currently
    waits in (aging lowers it); ``service_class`` (level ``class_level``) is the class it is
    served, charged and counted as. ``deadline`` is the
    absolute time its first token is due. ``gen`` changes on every transition, so timers set in an
    earlier state are recognised as stale without searching for them.
    """

    __slots__ = (
        "ages_at",
        "arrival",
        "avoid",
        "cached_tokens",
        "ceiling",
        "charged_tpm",
        "class_level",
        "cost",
        "deadline",
        "dispatched_at",
        "enqueued_at",
        "est_output_tokens",
        "evictions",
        "expires_at",
        "failures",
        "finished_at",
        "first_token_at",
        "forecast",
        "gen",
        "id",
        "lent",
        "level",
        "load_cost",
        "loads",
        "max_tokens",
        "model",
        "moves",
        "order",
        "output_tokens",
        "preemptions",
        "prefix",
        "promotions",
        "prompt_tokens",
        "ran_since",
        "reason",
        "replica",
        "requested_class",
        "resumable",
        "retry_after",
        "retry_key",
        "seq",
        "service_class",
        "session",
        "state",
        "streamed",
        "tag",
        "tagged_by",
        "tenant",
    )

    def __init__(
        self,
        id: str,
        tenant: str,
        service_class: str,
        level: int,
        arrival: float,
        deadline: float,
        prompt_tokens: int,
        max_tokens: int,
        *,
        requested_class: str | None = None,
        est_output_tokens: int | None = None,
        model: str = "",
        prefix: Prefix | None = None,
        session: str | None = None,
    ) -> None:
        self.id = id
        self.tenant = tenant
        self.service_class = service_class
        self.requested_class = requested_class or service_class
        self.level = level
        self.class_level = level  # the service class's level: never changes, aging or not
        self.arrival = arrival
        self.deadline = deadline
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.est_output_tokens = max_tokens if est_output_tokens is None else est_output_tokens
        # the configured output ceiling of its class and tenant (None: none)
        self.ceiling: int | None = None
        self.cost = 0.0
        self.state = NEW
        self.reason = ""
        self.gen = 0
        self.seq = 0
        self.replica: str | None = None
        self.enqueued_at = arrival
        self.expires_at = _INF  # queue timeout while queued
        self.ages_at = _INF  # next aging promotion while queued
        self.dispatched_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.output_tokens = 0
        self.preemptions = 0
        self.promotions = 0
        self.retry_after: float | None = None
        # what a client's retry of this request shares with its earlier attempts (the I/O
        # layer's fingerprint of tenant and body; the simulator's first request id): a retry
        # that comes back when its refusal said finds the room admission kept for it
        self.retry_key: str | None = None
        # its TTFT as admission forecast it (seconds from arrival; 0: none made), against which
        # its actual TTFT calibrates the next forecasts
        self.forecast = 0.0
        self.charged_tpm = 0
        self.model = model  # "" = any replica may serve it
        self.failures = 0  # attempts that failed before the first byte
        self.avoid: str | None = None  # the replica its last attempt failed on
        self.streamed = 0  # output tokens sent to the client so far (``progress``)
        # in flight in a slot lent from a reserve: LENT_PREEMPTIBLE while it can still give it
        # back, LENT_STREAMING once it streams (it returns the slot when it ends)
        self.lent = NOT_LENT
        # the fair-share counter it was last picked at (its rank inside its engine band under
        # ``qos``), and the counters that hold that tag until it starts
        self.tag = 0.0
        self.tagged_by: Releasable | None = None
        # the order the engine is asked to run it in (``engine_order``; smaller first), kept
        # through retries and aging (never later than when first dispatched); None until then
        self.order: int | None = None
        # its prompt's block keys (None: unknown) and the conversation it belongs to (None:
        # none named): where it is cheapest to run
        self.prefix = prefix
        self.session = session
        # of its prompt, the tokens the router expected its replica to hold cached when it was
        # placed (not charged to its tenant's fair share; see ``Scheduler.complete``)
        self.cached_tokens = 0
        # what loading its model cold costs (a LoRA adapter's ``load_cost``, in reference
        # tokens; 0 for a model), and the replicas it made load it: each load is charged to its
        # tenant's fair share
        self.load_cost = 0.0
        self.loads = 0
        # whether its answer can continue on any replica from the tokens it delivered (a
        # stream whose body a continuation reproduces exactly: ``wire/resume.py``), set by the
        # I/O layer; evictions (pulled back after its first byte for a more urgent request) and
        # moves (continued elsewhere after its replica failed mid-stream) so far; and when its
        # current engine call began (a stream just resumed is not evicted again at once)
        self.resumable = False
        self.evictions = 0
        self.moves = 0
        self.ran_since = 0.0

    def move(self, to: State, reason: str = "") -> None:
        if to not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"request {self.id}: {self.state.value} -> {to.value}")
        self.state = to
        self.gen += 1
        if reason:
            self.reason = reason

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first, once it has finished with two or more
        (vLLM's benchmark definition); None otherwise."""
        first, end = self.first_token_at, self.finished_at
        if first is None or end is None or self.output_tokens < 2:
            return None
        return (end - first) / (self.output_tokens - 1)

    def __repr__(self) -> str:
        return (
            f"Request({self.id!r}, tenant={self.tenant!r}, class={self.service_class!r}, "
            f"level={self.level}, state={self.state.value})"
        )
