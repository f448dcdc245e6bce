"""A simulated GPU inference engine: vLLM-style continuous batching in modelled (virtual) time.

Why a simulator: QoS policies must be compared on an hour-long production trace in seconds, without
a GPU, and the very same engine must also back the real-time gateway. So ``SimEngine`` is sans-I/O:
it never reads a clock; each step returns its *modelled* duration and the driver owns time.

Step time (all coefficients come from an ``EngineProfile``; see ``profiles/*.yaml`` for how each
number is derived)::

    step_fixed_s + prefill_s_per_token * prefill tokens in the step
                 + prefill_s_per_ctx_token * (prefill token, token it attends to) pairs
                 + decode_s_per_ctx_token * context tokens of the decoding seqs
                 + decode_s_per_seq * number of decoding seqs

A decoding seq's context is its prompt plus every token generated so far (the KV it attends to).
A prefill chunk of k tokens after c computed ones attends to ``k * c + k * (k + 1) / 2`` pairs:
the attention cost that grows with the square of a long prompt (0 in the built-in profiles,
whose linear term holds it; ``qosgate calibrate`` fits it where an engine shows it, as a CPU does).

Scheduling per step, modelled on vLLM's chunked-prefill scheduler (decodes first, as in V0 and
Sarathi-Serve): every running decode seq gets one token; what is left of the
``max_num_batched_tokens`` budget goes to unfinished prefills of running seqs (admission order),
then to waiting seqs, at most ``max_num_seqs`` running. The step that completes a prefill samples
the first token. KV is counted in tokens: a seq holds one slot per token whose KV was computed.

Prefix cache (``prefix_cache.PrefixCache``), for a seq whose ``SeqSpec.prefix`` is set: when it is
admitted (again after a recompute eviction) its leading cached blocks count as computed, at most
``(prompt + generated - 1) // block`` of them (vLLM always computes the last token, to sample
from), so its prefill costs only the rest; each full prompt block is cached (pinned by the seq)
as its prefill covers it, and stays cached, unpinned, in an LRU after the seq ends or is evicted.
The LRU is bounded by the KV the seqs do not hold (trimmed after every step). Simplification:
each seq counts every KV slot it uses, so two running seqs that share cached blocks count them
twice in ``kv_used`` (vLLM counts them once): the model is pessimistic on KV under sharing, never
over capacity. ``prefix_cache_queries``/``hits`` count prompt tokens of first admissions only, as
vLLM 0.32 does (a preempted request's lookups are kept apart there).

Host tier (``host_kv_tokens`` > 0), modelled on vLLM 0.32's native CPU offloading
(``--kv-offloading-size``, the ``OffloadingConnector``): write-through, not spill-on-evict --
every full prompt block a seq's prefill computes or a hit adopts is also stored in host DRAM, an
LRU bounded by ``host_kv_tokens`` (a finished request's blocks are made most recent, head last,
as vLLM's LRU policy does at request end). At admission, after the GPU cache's leading run, the
run of following blocks the host tier holds is loaded (same last-token cap on the two together):
those tokens count as computed, are GPU-cached from then on, and add ``host_load_s_per_token``
each to the step (vLLM loads asynchronously, the request waiting while other seqs run: charging
the step is pessimistic for the others, optimistic for none). Counted as vLLM's connector stats:
``external_prefix_cache_queries`` (prompt minus the GPU hit) and ``external_prefix_cache_hits``
(tokens loaded), first admissions only; ``prefix_cache_hits`` stays the GPU's own.

Preemption is recompute-style (vLLM V1 default): when a running seq cannot get KV slots, a victim
(the most recently admitted under "fcfs", the largest ``engine_priority`` value then latest arrival
under "priority") loses its KV and goes back to the head of the waiting queue; on readmission it
re-prefills prompt + generated tokens and its next token continues the index. As in vLLM V1, no
waiting seq is admitted in a step that preempted. Under "priority" the waiting queue is ordered by
priority and, by default, that is all: a waiting seq never preempts a running one, whether
``max_num_seqs`` or the KV cache holds it back -- vLLM V1's scheduler, 0.32 included, preempts
only to give a *running* seq KV (vLLM issue #40004). ``preempt_for_priority=True`` is vLLM V0's
rule (``_schedule_priority_preemption``, and the open pull requests for #40004): a waiting seq
that does not fit preempts running seqs with a strictly larger value.

Several models on one accelerator (``models``: model -> its profile, for the seqs whose
``SeqSpec.model`` names it; any other seq runs on ``profile``). Co-located models take turns:
one step runs each model's forward pass in sequence, so the step lasts the sum of each model's
step time over its own seqs (its fixed cost once, if it has a seq in the step, plus its terms
per token). The batch, the token budget and the KV cache are ``profile``'s, shared by every
model's seqs (a simplification: a real deployment splits the memory between the models' KV
caches; counting it as one pool is optimistic when one model's seqs would fill its own part).

Engine time (``engine_time``, kept when the engine is ``timed``): each step's duration is split
between the seqs in it, so that the seqs' times add up to the engine's busy time. A seq is
charged its own terms (its prefill tokens, its attention pairs, its decode context and per-seq
cost, the host-tier tokens it loads) and a share of its model's fixed step cost in proportion to
the tokens it computes in the step (the fixed cost -- streaming the weights once -- serves every
token of the pass alike). A step in which the seq prefills counts as its prefill time, one in
which it decodes as its decode time; a host-tier load counts as prefill.

One module (~860 lines): the profile schema is a few lines, and the rest -- the waiting queue, the
running set, KV accounting, preemption, the seqs' pins in the prefix cache and their engine time
-- is one step function's state; apart, each piece would reach into the others' counters.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field

from qosgate.config import Strict
from qosgate.models.filler import context_of, next_id, seeded_context, word
from qosgate.models.prefix_cache import PrefixCache
from qosgate.models.step import EvictEvent, FinishEvent, SeqSpec, StepResult, TokenEvent

Policy = Literal["fcfs", "priority"]
Event = TokenEvent | FinishEvent | EvictEvent

PROFILE_DIR = Path(__file__).parent / "profiles"
PROFILE_ALIASES: dict[str, str] = {"default": "qwen2.5-7b-instruct-h100"}


class EngineProfile(Strict):
    """Performance and capacity model of one model on one GPU (times in seconds)."""

    name: str
    model: str
    gpu: str
    # where the numbers came from (derived from datasheets, or fitted by `qosgate calibrate`
    # against a named endpoint): a profile that says nothing is not to be trusted blindly
    source: str = ""
    step_fixed_s: float = Field(gt=0)  # > 0 so that time always advances
    prefill_s_per_token: float = Field(ge=0)
    prefill_s_per_ctx_token: float = Field(default=0.0, ge=0)
    decode_s_per_ctx_token: float = Field(ge=0)
    decode_s_per_seq: float = Field(ge=0)
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    kv_capacity_tokens: int = Field(ge=1)
    # KV bytes of one token (the model's layers x KV heads x head dim x 2 x dtype bytes): turns
    # a host buffer given in GiB (vLLM's ``--kv-offloading-size``) into tokens; 0: not given
    kv_bytes_per_token: int = Field(default=0, ge=0)
    # the host (CPU DRAM) KV tier of vLLM's native offloading: its size in tokens (0: none)
    # and the time to load one cached token's KV from it into the GPU
    host_kv_tokens: int = Field(default=0, ge=0)
    host_load_s_per_token: float = Field(default=0.0, ge=0)


def available_profiles() -> list[str]:
    """Names accepted by ``load_profile`` besides file paths."""
    return sorted([p.stem for p in PROFILE_DIR.glob("*.yaml")] + list(PROFILE_ALIASES))


def load_profile(name_or_path: str | Path) -> EngineProfile:
    """Load a built-in profile by name (or alias), or any YAML file by path."""
    path = Path(name_or_path)
    if not path.is_file():
        name = str(name_or_path)
        path = PROFILE_DIR / f"{PROFILE_ALIASES.get(name, name)}.yaml"
        if not path.is_file():
            raise ValueError(f"unknown engine profile {name!r}; known: {available_profiles()}")
    with path.open(encoding="utf-8") as f:
        return EngineProfile.model_validate(yaml.safe_load(f))


def with_host_tier(profile: EngineProfile, gib: float, block_tokens: int) -> EngineProfile:
    """``profile`` with a host KV tier of ``gib`` GiB, as vLLM sizes ``--kv-offloading-size``:
    the bytes over the KV bytes of a block, in whole blocks of ``block_tokens``."""
    if gib <= 0:
        raise ValueError("the KV offloading size must be > 0 GiB")
    if not profile.kv_bytes_per_token:
        raise ValueError(f"profile {profile.name!r} gives no kv_bytes_per_token")
    blocks = int(gib * (1 << 30)) // (profile.kv_bytes_per_token * block_tokens)
    return profile.model_copy(update={"host_kv_tokens": blocks * block_tokens})


@dataclass(slots=True)
class EngineMetrics:
    """What a vLLM-compatible /metrics endpoint publishes (gauges, then monotonic counters)."""

    num_running: int
    num_waiting: int
    num_paused: int
    kv_usage: float
    prompt_tokens_total: int
    generation_tokens_total: int
    preemptions_total: int
    steps_total: int
    busy_s_total: float
    # inter-token latency totals (vllm:inter_token_latency_seconds _sum/_count): every token
    # after a seq's first counts the step it came in
    itl_s_total: float = 0.0
    itl_tokens_total: int = 0
    # vllm:prefix_cache_queries / vllm:prefix_cache_hits: prompt tokens looked up / found cached
    # at a request's first admission
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # tokens fed to prefill steps (recomputation included): what the prefix cache saves
    prefill_tokens_total: int = 0
    # with several models: per model, (engine seconds, prompt tokens, output tokens) of its
    # seqs since the engine started (``SimEngine.model_time``)
    model_time: tuple[tuple[str, float, int, int], ...] = ()
    # vllm:external_prefix_cache_queries / _hits: with a host tier, the prompt tokens the GPU
    # cache did not give (looked up in the host tier) and those loaded from it, at a request's
    # first admission; total hit tokens = prefix_cache_hits + external_prefix_cache_hits
    external_prefix_cache_queries_total: int = 0
    external_prefix_cache_hits_total: int = 0


@dataclass(slots=True)
class Advance:
    """Outcome of ``SimEngine.advance``.

    ``now`` is the virtual time at the end of the last step run (unchanged if none ran);
    ``events`` are ``(time, event)`` pairs in order: tokens and finishes at the end of their step,
    evictions at the start of theirs (when the scheduler decided them); ``steps`` counts forward
    steps run, ``0`` meaning the engine cannot progress until the driver adds/resumes/aborts.
    """

    now: float
    steps: int
    events: list[tuple[float, Event]] = field(default_factory=list)


_WAITING, _RUNNING, _PAUSED = 0, 1, 2

class _Seq:
    __slots__ = (
        "admitted",
        "block",
        "cached",
        "computed",
        "context",
        "full",
        "gen",
        "id",
        "keys",
        "limit",
        "loading",
        "max_tokens",
        "model",
        "order",
        "pinned",
        "prio",
        "prompt",
        "prompted",
        "spent",
        "state",
    )

    def __init__(self, spec: SeqSpec, order: int, room: int, spent: list[float]) -> None:
        self.id = spec.seq_id
        self.model = spec.model
        # its engine time so far, [prefill seconds, decode seconds] (``SimEngine.engine_time``)
        self.spent = spent
        self.loading = 0  # tokens it loads from the host tier in the step being scheduled
        self.prompt = spec.prompt_tokens
        # no cap of the client's own: the rest of the KV cache (vLLM: the rest of the context)
        self.max_tokens = room if spec.max_tokens is None else spec.max_tokens
        target = spec.target_output_tokens
        self.limit = max(1, self.max_tokens if target is None else min(target, self.max_tokens))
        self.prio = spec.engine_priority
        self.order = order
        self.computed = 0  # tokens whose KV is in the cache (== KV slots held)
        self.gen = 0  # tokens generated (and emitted) so far
        self.state = _WAITING
        # its first token is not the sequence's first: it has prompt ids (``filler.word``)
        self.prompted = spec.context_ids is not None
        # the two last ids of the sequence, the next token's context (``filler``): the prompt's
        # when it has ids, else seeded from its id; it moves with the tokens reported only (the
        # simulator's closed-form stretches report none after the first, and need no ids)
        self.context = (context_of(spec.context_ids) if spec.context_ids is not None
                        else seeded_context(spec.seq_id))
        self.admitted = False  # taken from the waiting queue at least once
        # prefix cache: its block keys (None: no identity, nothing cached), the tokens of one,
        # its full prompt blocks, how many leading ones it pins now, prompt tokens found cached
        self.pinned = self.cached = self.full = self.block = 0
        prefix = spec.prefix
        if prefix is None or not prefix.keys:
            self.keys = None
        else:
            self.keys = prefix.keys
            self.block = prefix.block_tokens
            self.full = min(len(prefix.keys), self.prompt // prefix.block_tokens)

    def remaining(self) -> int:
        """Tokens still to feed before the next token can be sampled."""
        return self.prompt + self.gen - self.computed

    def is_decoding(self) -> bool:
        return self.gen > 0 and self.computed == self.prompt + self.gen - 1


class _WaitQueue:
    """The engine's waiting queue: arrival order ("fcfs") or (engine_priority, arrival) heap."""

    def __init__(self, policy: Policy) -> None:
        self.fcfs = policy == "fcfs"
        self._dq: deque[_Seq] = deque()
        self._heap: list[tuple[int, int, _Seq]] = []

    def __len__(self) -> int:
        return len(self._dq) if self.fcfs else len(self._heap)

    def push(self, s: _Seq, front: bool = False) -> None:
        if not self.fcfs:
            heappush(self._heap, (s.prio, s.order, s))
        elif front:
            self._dq.appendleft(s)
        else:
            self._dq.append(s)

    def peek(self) -> _Seq:
        return self._dq[0] if self.fcfs else self._heap[0][2]

    def pop(self) -> _Seq:
        return self._dq.popleft() if self.fcfs else heappop(self._heap)[2]

    def remove(self, s: _Seq) -> None:
        if self.fcfs:
            self._dq.remove(s)
        else:
            self._heap = [e for e in self._heap if e[2] is not s]
            heapify(self._heap)


class SimEngine:
    """``StepEngine`` over a modelled GPU; see the module docstring for the model.

    Use ``step()`` in real time (the gateway sleeps ``duration_s``), ``advance()`` in the simulator.
    """

    def __init__(
        self, profile: EngineProfile | str | Path = "default", policy: Policy = "fcfs",
        preempt_for_priority: bool = False, models: Mapping[str, EngineProfile] | None = None,
        timed: bool = False,
    ) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown policy {policy!r}")
        self.profile = profile if isinstance(profile, EngineProfile) else load_profile(profile)
        # the step time of each model it serves besides ``profile``'s (module doc); empty: one
        self.models: dict[str, EngineProfile] = dict(models or {})
        # whether it keeps each seq's engine time (``engine_time``: a little work per seq and
        # step, so only when asked; always with several models, whose step time is summed
        # from it)
        self.timed = timed or bool(self.models)
        self._time: dict[str, list[float]] = {}  # seq id -> [prefill s, decode s]
        # per model, of its seqs that ended: [engine seconds, prompt tokens, output tokens]
        self._model_done: dict[str, list[float]] = {}
        self.policy: Policy = policy
        # vLLM V0's rule: a waiting seq preempts running ones of a larger value (module doc)
        self.preempts = policy == "priority" and preempt_for_priority
        self.ordered = policy == "priority"
        self.max_num_seqs = self.profile.max_num_seqs
        self._seqs: dict[str, _Seq] = {}
        self._running: dict[str, _Seq] = {}  # insertion order == admission order
        self._waiting = _WaitQueue(policy)
        self._n_paused = 0
        self._kv_used = 0
        self._order = 0
        self._prompt_total = 0
        self._gen_total = 0
        self._preempt_total = 0
        self._steps = 0
        self._busy = 0.0
        self._itl_s = 0.0
        self._itl_n = 0
        self._cache = PrefixCache()
        self._pc_queries = 0
        self._pc_hits = 0
        self._prefill_total = 0
        # host tier (vLLM's native CPU offloading): its blocks (an LRU, never pinned), the
        # tokens it loads into the GPU in the step being scheduled, its counters
        self._host = PrefixCache() if self.profile.host_kv_tokens else None
        self._loading = 0
        self._ext_queries = 0
        self._ext_hits = 0

    # ---- StepEngine ----------------------------------------------------------------------------

    def add(self, spec: SeqSpec) -> None:
        if spec.seq_id in self._seqs:
            raise ValueError(f"duplicate seq_id {spec.seq_id!r}")
        if spec.prompt_tokens < 1 or (spec.max_tokens is not None and spec.max_tokens < 1):
            raise ValueError("prompt_tokens and max_tokens must be >= 1")
        spent = self._time.setdefault(spec.seq_id, [0.0, 0.0]) if self.timed else [0.0, 0.0]
        s = _Seq(spec, self._order, self.profile.kv_capacity_tokens - spec.prompt_tokens, spent)
        if s.model not in self.models:
            s.model = ""  # the engine's own profile
        if s.prompt + s.limit > self.profile.kv_capacity_tokens:
            raise ValueError(f"{spec.seq_id!r}: prompt + output cannot fit the KV cache")
        self._order += 1
        self._seqs[s.id] = s
        self._waiting.push(s)

    def pause(self, seq_id: str) -> None:
        """Unknown/finished/already paused ids are ignored: pausing races with finishing."""
        s = self._seqs.get(seq_id)
        if s is None or s.state == _PAUSED:
            return
        if s.state == _RUNNING:
            del self._running[seq_id]
        else:
            self._waiting.remove(s)
        s.state = _PAUSED
        self._n_paused += 1

    def resume(self, seq_id: str) -> None:
        """The seq goes to the head of the waiting queue (by key under "priority"), KV intact."""
        s = self._seqs.get(seq_id)
        if s is None or s.state != _PAUSED:
            return
        s.state = _WAITING
        self._n_paused -= 1
        self._waiting.push(s, front=True)

    def abort(self, seq_id: str) -> None:
        s = self._seqs.pop(seq_id, None)
        if s is None:
            return
        if self.models:
            self._ended(s)
        if s.state == _RUNNING:
            del self._running[seq_id]
        elif s.state == _WAITING:
            self._waiting.remove(s)
        else:
            self._n_paused -= 1
        self._kv_used -= s.computed
        self._release(s, finished=True)

    def has_work(self) -> bool:
        return bool(self._running) or len(self._waiting) > 0

    def step(self) -> StepResult:
        """One step; every token is reported. Nothing schedulable gives ``duration_s == 0``."""
        res = StepResult(duration_s=0.0)
        self._step(res, emit_all=True)
        return res

    # ---- fast path for the simulator -----------------------------------------------------------

    def advance(self, until: float, now: float, *, emit_all_tokens: bool = False) -> Advance:
        """Run steps from virtual time ``now`` while the next step would start before ``until``.

        Returns right after the first step that yields a first token (index 0), a finish or an
        eviction, or when the next step would start at/after ``until`` (e.g. the next arrival), or
        when nothing can run. With ``emit_all_tokens=False`` only index-0 tokens are reported and
        stretches of pure decode steps with no such event are computed in closed form; the times
        are those of stepping one by one (up to float rounding). ``emit_all_tokens=True`` steps one
        by one and reports every token.
        """
        out = Advance(now=now, steps=0)
        res = StepResult(duration_s=0.0)
        while out.now < until and self.has_work():
            if not emit_all_tokens and self._coalesce(until - out.now, out):
                continue
            ran, interesting = self._step(res, emit_all=emit_all_tokens)
            t0, t1 = out.now, out.now + res.duration_s
            out.events.extend((t0, e) for e in res.evicted)
            out.events.extend((t1, e) for e in res.tokens)
            out.events.extend((t1, e) for e in res.finished)
            out.now = t1
            out.steps += ran
            if interesting or not ran:
                break
        return out

    def _coalesce(self, horizon: float, out: Advance) -> int:
        """Run K > 0 pure-decode steps in closed form if the batch is stable; return K (or 0).

        Stable: every running seq decodes, no waiting seq can be admitted or preempt, and the
        next K steps neither finish a seq nor overflow KV. Step j then lasts D0 + A*j (context
        grows by n tokens per step), so K steps last K*D0 + A*K*(K-1)/2.
        """
        run = self._running
        n = len(run)
        p = self.profile
        if n == 0 or n > p.max_num_batched_tokens:
            return 0
        ctx = 0
        k_fin = 1 << 62
        max_prio = -(1 << 62)
        for s in run.values():
            if s.gen == 0 or s.computed != s.prompt + s.gen - 1:
                return 0
            ctx += s.computed + 1
            if s.limit - s.gen < k_fin:
                k_fin = s.limit - s.gen
            if s.prio > max_prio:
                max_prio = s.prio
        if len(self._waiting):
            head = self._waiting.peek()
            if self._head_fits(head) or (self.preempts and max_prio > head.prio):
                return 0
        k = min(k_fin - 1, (p.kv_capacity_tokens - self._kv_used) // n)
        if k <= 0:
            return 0
        if self.models:
            d0, acc, fixed = self._decode_terms(run.values())
        else:
            d0 = p.step_fixed_s + p.decode_s_per_ctx_token * ctx + p.decode_s_per_seq * n
            acc = p.decode_s_per_ctx_token * n
            fixed = {"": p.step_fixed_s / n}
        k = min(k, _steps_starting_before(horizon, d0, acc))
        if self.timed:
            models = self.models
            ramp = k * (k - 1) / 2
            for s in run.values():
                q = models.get(s.model, p) if models else p
                # its k decode steps: each its share of the fixed cost and its own terms, its
                # context one token longer every step
                s.spent[1] += (k * (fixed[s.model] + q.decode_s_per_seq
                                    + q.decode_s_per_ctx_token * (s.computed + 1))
                               + q.decode_s_per_ctx_token * ramp)
        for s in run.values():
            s.computed += k
            s.gen += k
        self._kv_used += n * k
        lru = self._cache.lru_tokens
        if lru and lru > p.kv_capacity_tokens - self._kv_used:
            self._cache.trim(p.kv_capacity_tokens - self._kv_used)
        self._gen_total += n * k
        self._steps += k
        dur = k * d0 + acc * k * (k - 1) / 2
        self._busy += dur
        self._itl_s += n * dur
        self._itl_n += n * k
        out.now += dur
        out.steps += k
        return k

    def _decode_terms(self, seqs: Iterable[_Seq]) -> tuple[float, float, dict[str, float]]:
        """A pure-decode step of ``seqs`` on several models: its duration now, what it grows by
        each step (every context one token longer), and each model's fixed cost per seq."""
        count: dict[str, int] = {}
        for s in seqs:
            count[s.model] = count.get(s.model, 0) + 1
        d0 = acc = 0.0
        for s in seqs:
            q = self.models.get(s.model, self.profile)
            d0 += q.decode_s_per_seq + q.decode_s_per_ctx_token * (s.computed + 1)
            acc += q.decode_s_per_ctx_token
        fixed: dict[str, float] = {}
        for model, n in count.items():
            q = self.models.get(model, self.profile)
            d0 += q.step_fixed_s
            fixed[model] = q.step_fixed_s / n
        return d0, acc, fixed

    # ---- metrics -------------------------------------------------------------------------------

    def metrics(self) -> EngineMetrics:
        return EngineMetrics(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            num_paused=self._n_paused,
            kv_usage=self._kv_used / self.profile.kv_capacity_tokens,
            prompt_tokens_total=self._prompt_total,
            generation_tokens_total=self._gen_total,
            preemptions_total=self._preempt_total,
            steps_total=self._steps,
            busy_s_total=self._busy,
            itl_s_total=self._itl_s,
            itl_tokens_total=self._itl_n,
            prefix_cache_queries_total=self._pc_queries,
            prefix_cache_hits_total=self._pc_hits,
            prefill_tokens_total=self._prefill_total,
            external_prefix_cache_queries_total=self._ext_queries,
            external_prefix_cache_hits_total=self._ext_hits,
            model_time=self.model_time() if self.models else (),
        )

    def _ended(self, s: _Seq) -> None:
        acc = self._model_done.setdefault(s.model, [0.0, 0, 0])
        acc[0] += s.spent[0] + s.spent[1]
        acc[1] += min(s.computed, s.prompt)
        acc[2] += s.gen

    def model_time(self) -> tuple[tuple[str, float, int, int], ...]:
        """Per model served, (engine seconds, prompt tokens, output tokens) of its seqs since the
        engine started, the live ones' so far: each model's share of the accelerator, as an
        engine serving several models would export it per model, for the gateway to learn the
        models' weights from (``core.weights``). O(live seqs)."""
        acc = {m: list(v) for m, v in self._model_done.items()}
        for sq in self._seqs.values():
            a = acc.setdefault(sq.model, [0.0, 0, 0])
            a[0] += sq.spent[0] + sq.spent[1]
            a[1] += min(sq.computed, sq.prompt)
            a[2] += sq.gen
        return tuple((m, a[0], int(a[1]), int(a[2])) for m, a in sorted(acc.items()))

    def generated(self, seq_id: str) -> int:
        """Tokens generated so far by a live seq (also valid after a closed-form stretch)."""
        return self._seqs[seq_id].gen

    def engine_time(self) -> dict[str, tuple[float, float]]:
        """Every seq ever added (by id, ended ones too): its share of the steps it took part
        in, (prefill seconds, decode seconds); together they make ``busy_s_total``. Empty
        unless the engine is ``timed``."""
        return {sid: (t[0], t[1]) for sid, t in self._time.items()}

    # ---- scheduling ----------------------------------------------------------------------------

    def _head_fits(self, head: _Seq, hit: int = 0) -> bool:
        """Could ``head`` be admitted once every running seq has taken one token of budget/KV,
        ``hit`` of its tokens taken from the prefix cache? (A hit never makes it fit sooner:
        the cached tokens take KV too, so ``hit=0`` is the lower bound of what it needs.)"""
        n = len(self._running)
        p = self.profile
        left = p.max_num_batched_tokens - n
        if n >= p.max_num_seqs or left <= 0:
            return False
        need = hit + min(head.remaining() - hit, left)
        return need <= p.kv_capacity_tokens - self._kv_used - n

    # ---- prefix cache --------------------------------------------------------------------------

    def _hit(self, s: _Seq) -> int:
        """Prompt tokens of a waiting seq holding no KV that the prefix cache would give it:
        the GPU cache's leading run, then the host tier's run after it (at most the blocks
        before the last token, together)."""
        if s.keys is None or s.computed:
            return 0
        most = min(s.full, (s.prompt + s.gen - 1) // s.block)
        gpu = self._cache.lookup(s.keys, most)
        if self._host is None or gpu == most:
            return gpu * s.block
        return (gpu + self._host.lookup(s.keys[gpu:], most - gpu)) * s.block

    def _admit_cached(self, s: _Seq, hit: int) -> None:
        """``s`` is admitted: it takes its ``hit`` cached tokens (pinned) as computed; those the
        GPU cache lacked are loaded from the host tier in this step (and GPU-cached from now)."""
        loaded = 0
        if hit and self._host is not None:
            assert s.keys is not None
            loaded = hit - self._cache.lookup(s.keys, hit // s.block) * s.block
            self._loading += loaded
            s.loading = loaded
        if not s.admitted:
            s.admitted = True
            s.cached = hit
            self._pc_queries += s.prompt
            self._pc_hits += hit - loaded
            if self._host is not None:
                self._ext_queries += s.prompt - (hit - loaded)
                self._ext_hits += loaded
        if hit:
            assert s.keys is not None
            s.pinned = hit // s.block
            self._cache.pin(s.keys[: s.pinned])
            if self._host is not None:
                self._store(s.keys[: s.pinned], s.block)
            s.computed = hit
            self._kv_used += hit

    def _cache_computed(self, s: _Seq, computed: int) -> None:
        """Pin (and so cache) the full prompt blocks ``computed`` tokens of ``s`` cover."""
        assert s.keys is not None
        upto = min(s.full, computed // s.block)
        if upto > s.pinned:
            self._cache.pin(s.keys[s.pinned : upto])
            if self._host is not None:
                self._store(s.keys[s.pinned : upto], s.block)
            s.pinned = upto

    def _store(self, keys: Sequence[int], block_tokens: int) -> None:
        """Write-through to the host tier, as vLLM's offloading connector stores every block
        a step computes (or a hit adopts): most recent first, the coldest dropped past its size."""
        host = self._host
        assert host is not None
        host.touch(keys, block_tokens)
        if host.lru_tokens > self.profile.host_kv_tokens:
            host.trim(self.profile.host_kv_tokens)

    def _release(self, s: _Seq, finished: bool = False) -> None:
        """``s`` lets go of its blocks (finished, evicted, aborted): they stay cached, unpinned.
        A finished request's blocks become the host tier's most recent, head last (vLLM's LRU
        policy refreshes a request's keys when it finishes; a preemption does not)."""
        if s.pinned:
            assert s.keys is not None
            keys = s.keys[: s.pinned]
            self._cache.unpin(keys, s.block)
            if finished and self._host is not None:
                self._store(keys, s.block)
            s.pinned = 0

    def _victim(self) -> _Seq:
        if self._waiting.fcfs:
            return next(reversed(self._running.values()))
        return max(self._running.values(), key=lambda s: (s.prio, s.order))

    def _evict(self, s: _Seq, evicted: list[EvictEvent]) -> None:
        del self._running[s.id]
        self._kv_used -= s.computed
        s.computed = 0
        self._release(s)
        s.state = _WAITING
        self._waiting.push(s, front=True)
        self._preempt_total += 1
        evicted.append(EvictEvent(s.id))

    def _schedule(self, evicted: list[EvictEvent]) -> dict[_Seq, int]:
        """Pick the tokens each seq computes this step (vLLM order, decodes first)."""
        p = self.profile
        waiting = self._waiting
        if self.preempts:
            while len(waiting) and self._running:
                head = waiting.peek()
                if self._head_fits(head, 0 if head.keys is None else self._hit(head)):
                    break
                victim = self._victim()
                if victim.prio <= waiting.peek().prio:
                    break
                self._evict(victim, evicted)
        budget = p.max_num_batched_tokens
        free = p.kv_capacity_tokens - self._kv_used
        sched: dict[_Seq, int] = {}
        running = list(self._running.values())
        order = [s for s in running if s.is_decoding()]
        order += [s for s in running if not s.is_decoding()]
        preempted = False
        for s in order:
            if budget == 0:
                break
            if s.state != _RUNNING:
                continue  # already taken as a victim in this step
            k = min(s.remaining(), budget)
            while k > free:
                v = self._victim()
                refund = sched.pop(v, 0)
                budget += refund
                free += refund + v.computed
                self._evict(v, evicted)
                preempted = True
                if v is s:
                    break
            if s.state != _RUNNING:
                break
            sched[s] = k
            free -= k
            budget -= k
        if not preempted:
            while budget > 0 and len(waiting) and len(self._running) < p.max_num_seqs:
                s = waiting.peek()
                hit = self._hit(s) if s.keys is not None else 0
                k = min(s.remaining() - hit, budget)
                if k + hit > free:
                    break
                waiting.pop()
                s.state = _RUNNING
                self._running[s.id] = s
                if s.keys is not None:
                    self._admit_cached(s, hit)
                elif not s.admitted:
                    s.admitted = True
                    self._pc_queries += s.prompt
                    if self._host is not None:
                        self._ext_queries += s.prompt
                sched[s] = k
                free -= k + hit
                budget -= k
        return sched

    def _charge_models(self, sched: dict[_Seq, int]) -> float:
        """A step of seqs on several models: each model's pass (its fixed cost, if it has a seq
        in the step, and its seqs' terms) one after the other; charges every seq its share and
        returns the step's duration."""
        tokens: dict[str, int] = {}
        for s, k in sched.items():
            tokens[s.model] = tokens.get(s.model, 0) + k
        dur = 0.0
        for s, k in sched.items():
            q = self.models.get(s.model, self.profile)
            dur += _charge(s, k, q, q.step_fixed_s / tokens[s.model])
        return dur

    def _step(self, res: StepResult, emit_all: bool) -> tuple[int, bool]:
        """Run one step into ``res``; return (forward passes run: 0/1, any index-0/finish/evict)."""
        res.tokens.clear()
        res.finished.clear()
        res.evicted.clear()
        sched = self._schedule(res.evicted)
        if not sched:
            res.duration_s = 0.0
            return 0, bool(res.evicted)
        p = self.profile
        prefill = ctx = n_dec = pairs = 0
        several = bool(self.models)
        # each seq's engine time (module doc), charged here on one model: its terms and its
        # share of the fixed cost, by the tokens it computes in the step
        charge = self.timed and not several
        fixed = p.step_fixed_s / sum(sched.values()) if charge else 0.0
        for s, k in sched.items():
            if s.is_decoding():
                n_dec += 1
                c = s.computed + 1
                ctx += c
                if charge:
                    s.spent[1] += fixed + p.decode_s_per_seq + p.decode_s_per_ctx_token * c
            else:
                prefill += k
                mine = k * s.computed + k * (k + 1) // 2
                pairs += mine
                if charge:
                    s.spent[0] += ((fixed + p.prefill_s_per_token) * k
                                   + p.prefill_s_per_ctx_token * mine)
                if s.pinned < s.full:  # its prefill covers more full prompt blocks
                    self._cache_computed(s, s.computed + k)
        self._prefill_total += prefill
        if several:
            dur = self._charge_models(sched)
        else:
            dur = (
                p.step_fixed_s
                + p.prefill_s_per_token * prefill
                + p.decode_s_per_ctx_token * ctx
                + p.decode_s_per_seq * n_dec
            )
            if p.prefill_s_per_ctx_token:
                dur += p.prefill_s_per_ctx_token * pairs
            if self._loading:
                dur += p.host_load_s_per_token * self._loading
            if self._loading and charge:
                for s in sched:  # (the seqs admitted with host-tier tokens to load)
                    if s.loading:
                        s.spent[0] += p.host_load_s_per_token * s.loading
                        s.loading = 0
        self._loading = 0
        res.duration_s = dur
        self._steps += 1
        self._busy += dur
        interesting = bool(res.evicted)
        for s, k in sched.items():
            s.computed += k
            self._kv_used += k
            if s.computed != s.prompt + s.gen:
                continue  # prefill chunk, no token yet
            idx = s.gen
            s.gen += 1
            self._gen_total += 1
            if idx == 0:
                self._prompt_total += s.prompt
                interesting = True
            else:
                self._itl_s += dur
                self._itl_n += 1
            if emit_all or idx == 0:
                tid = next_id(s.context)
                s.context = (s.context[1], tid)
                text = word(tid, first=idx == 0 and not s.prompted)
                res.tokens.append(TokenEvent(s.id, idx, text, tid))
            if s.gen >= s.limit:
                interesting = True
                reason: Literal["length", "stop"] = "length" if s.gen >= s.max_tokens else "stop"
                res.finished.append(FinishEvent(s.id, reason, s.prompt, s.gen, s.cached))
                del self._running[s.id]
                del self._seqs[s.id]
                if self.models:
                    self._ended(s)
                self._kv_used -= s.computed
                self._release(s, finished=True)
        lru = self._cache.lru_tokens
        if lru and lru > p.kv_capacity_tokens - self._kv_used:
            self._cache.trim(p.kv_capacity_tokens - self._kv_used)
        return 1, interesting


def _charge(s: _Seq, k: int, p: EngineProfile, fixed_per_token: float) -> float:
    """Charge ``s`` its share of a step in which it computes ``k`` tokens on profile ``p``
    (before they count as computed; module doc); returns it. Host-tier loads count as prefill."""
    if s.is_decoding():
        t = fixed_per_token + p.decode_s_per_seq + p.decode_s_per_ctx_token * (s.computed + 1)
        s.spent[1] += t
    else:
        t = ((fixed_per_token + p.prefill_s_per_token) * k
             + p.prefill_s_per_ctx_token * (k * s.computed + k * (k + 1) // 2))
        s.spent[0] += t
    if s.loading:
        load = p.host_load_s_per_token * s.loading
        s.spent[0] += load
        t += load
        s.loading = 0
    return t


def _steps_starting_before(horizon: float, d0: float, acc: float) -> int:
    """Number of steps j >= 0 whose start offset j*d0 + acc*j*(j-1)/2 is < ``horizon``."""
    if math.isinf(horizon):
        return 1 << 62

    def start(j: int) -> float:
        return j * d0 + acc * j * (j - 1) / 2

    if acc > 0:
        b = d0 - acc / 2
        j = math.ceil((-b + math.sqrt(b * b + 2 * acc * horizon)) / acc)
    else:
        j = math.ceil(horizon / d0)
    j = max(j, 1)
    while j > 1 and start(j - 1) >= horizon:
        j -= 1
    while start(j) < horizon:
        j += 1
    return j
