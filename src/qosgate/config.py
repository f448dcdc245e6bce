"""One configuration schema for every part of qosgate, loaded from YAML.

The defaults reproduce the seed articles, so ``qosgate serve`` works with zero config: four classes
realtime (P0) / api (P1) / batch (P2) / offline (P3); weights P1:P2:P3 = 5:3:2; aging after
10 s / 30 s / 60 s; tiers enterprise/pro/free (and vip/standard/basic) with boosts of -1/0/+1 level.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

PolicyName = Literal["fifo", "priority", "wfq", "qos"]


class Strict(BaseModel):
    """The base of every configuration model (here, ``settings.py``, the simulator's scenarios
    and workloads, engine profiles): a member it does not know is an error (a typo is not
    silently ignored), and a loaded configuration cannot change."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ServiceClass(Strict):
    """A service class: one queue band with its budgets and share."""

    name: str
    level: int = Field(ge=0, description="0 is the most urgent band")
    weight: float = Field(default=1.0, gt=0, description="share between non-strict classes")
    strict: bool = Field(default=False, description="served before every non-strict class")
    ttft_budget_ms: float = Field(gt=0, description="target time to first token; sets the deadline")
    tpot_budget_ms: float | None = Field(
        default=None, gt=0, description="target time per output token once streaming; judged "
        "in the SLO metrics (qosgate_slo_requests_total) with the TTFT budget. None = not judged"
    )
    queue_timeout_s: float = Field(gt=0, description="a request queued longer is timed out (504)")
    max_queue: int = Field(ge=1, description="queued requests of this class at most")
    aging_after_s: float | None = Field(
        default=None, gt=0, description="waiting this long promotes a request one level up"
    )
    deadline_admission: bool = Field(
        default=True, description="refuse at arrival (503 deadline_infeasible, with a "
        "Retry-After of when one like it would be admitted) a request whose forecast time to "
        "first token (the wait in qosgate's queue, then the first token's own service time, "
        "calibrated by how late past forecasts were: admission.quantile) exceeds the TTFT "
        "budget, while others contend for the fleet; false: admitted against admission_wait_s "
        "only"
    )
    admission_wait_s: float | None = Field(
        default=None, gt=0, description="reject at arrival (429/503 with a Retry-After from the "
        "predicted drain) when the predicted wait exceeds this; None = the queue timeout, so "
        "no request is accepted only to time out later. A smaller value sheds a class earlier"
    )
    preemptible: bool = Field(
        default=False, description="may be pulled back before its first token to make room"
    )
    can_preempt: bool = Field(default=False, description="may pull back preemptible requests")
    resume: bool = Field(
        default=False, description="a preemptible request that has begun streaming may be "
        "evicted too: its engine call is closed (the engine frees its slot), the tokens it "
        "delivered are kept, and it continues later on any replica of its model from there "
        "(its client sees a pause). Without it, a preemptible request is pulled back only "
        "before its first byte")
    reserved_share: float = Field(
        default=0.0, ge=0, lt=1, description="share of each replica's window kept for this "
        "class and the ones above; classes below that can be preempted may borrow it while "
        "it is idle (they give it back first), others may not")
    max_output_tokens: int | None = Field(
        default=None, ge=1, description="output ceiling of this class: a request asking for more "
        "is refused (400); one that asks for no cap is sent with this one, and its response "
        "says so (x-qosgate-inserted-max-tokens). None = what the client asks, as it asks it"
    )
    first_byte_timeout_s: float | None = Field(
        default=None,
        gt=0,
        description="an engine silent this long after dispatch is a failed attempt (retried "
        "elsewhere); None = max(30 s, 10 x the TTFT budget): a slow first byte from a busy "
        "engine is load, not a fault",
    )

    @model_validator(mode="after")
    def _resume_ok(self) -> ServiceClass:
        if self.resume and not self.preemptible:
            raise ValueError(f"class {self.name!r}: resume needs preemptible: true (only a "
                             "request that may be pulled back can be evicted)")
        return self

    @property
    def first_byte_timeout(self) -> float:
        if self.first_byte_timeout_s is not None:
            return self.first_byte_timeout_s
        return max(30.0, 10.0 * self.ttft_budget_ms / 1000.0)


class Tier(Strict):
    name: str
    boost: int = Field(default=0, description="levels added to the requested level (-1 = one "
                       "up); not to a Batch API job's lines")


class RateLimits(Strict):
    """A rate and concurrency limit set: a tenant's over all models, or its own on one model."""

    requests_per_minute: float | None = Field(default=None, gt=0)
    tokens_per_minute: float | None = Field(default=None, gt=0)
    max_concurrent: int | None = Field(default=None, ge=1)


class TenantLimits(RateLimits):
    max_output_tokens: int | None = Field(
        default=None, ge=1, description="output ceiling of this tenant's requests (with its "
        "class's, the smaller holds): as a class's max_output_tokens"
    )
    models: dict[str, RateLimits] = Field(
        default_factory=dict, description="limits of this tenant on one model each, by the "
        "model id clients send, on top of the limits above (a request must pass both): as "
        "OpenAI limits each model on its own. A LoRA adapter (models[].base) without an entry "
        "of its own counts against its base model's entry")


class Tenant(Strict):
    name: str
    api_keys: tuple[str, ...] = ()
    tier: str = "standard"
    weight: float = Field(default=1.0, gt=0, description="fair-share weight inside a class")
    default_class: str | None = None
    allowed_classes: tuple[str, ...] | None = Field(
        default=None, description="classes this tenant may use (naming another is a 403; a "
        "priority, task type, budget or default above them is clamped into them); None = all"
    )
    limits: TenantLimits = TenantLimits()


class Fairness(Strict):
    """Virtual token counter (VTC) costs: service = prompt_weight*prompt + output_weight*output."""

    prompt_weight: float = Field(default=1.0, ge=0)
    output_weight: float = Field(default=2.0, ge=0)
    reference_model: str | None = Field(
        default=None, description="the model whose tokens are the charged unit: the one a "
        "learned (auto) or profiled weight is measured against. Default: the first model "
        "listed in models")


class ModelSpec(Strict):
    """What one model costs, in the unit every tenant is charged: tokens of the reference model
    (``fairness.reference_model``). Without an entry a model costs what the reference does (the
    fairness weights alone), so a fleet of one model is charged as it always was. A token of a
    model that takes eight times the accelerator time of the reference's costs eight, so fair
    share between tenants is a fair share of engine time, whichever model each one calls."""

    name: str = Field(description="the model id clients send (a LoRA adapter's name too)")
    weight: float | Literal["auto"] = Field(
        default=1.0, description="cost of one of its tokens, in reference-model tokens (prompt "
        "and output alike unless prompt_weight / output_weight say otherwise). auto = learned "
        "online from its engines' own time per token (their /metrics), against the reference "
        "model's; 1 until both are measured")
    prompt_weight: float | None = Field(
        default=None, gt=0, description="cost of one prompt token (default: weight)")
    output_weight: float | None = Field(
        default=None, gt=0, description="cost of one output token (default: weight)")
    profile: str | None = Field(
        default=None, description="an engine profile (a name of the built-in ones, or a file "
        "that qosgate calibrate wrote) of this model's engine: its prefill and decode time per "
        "token against the reference model's profile set the weights (the reference needs a "
        "profile too)")
    base: str | None = Field(
        default=None, description="a LoRA adapter of this base model: it costs what the base "
        "does (unless given a weight of its own), plus load_cost when a replica has to load "
        "it")
    load_cost: float = Field(
        default=0.0, ge=0, description="an adapter's cold start, in reference-model tokens: "
        "charged to the request that makes a replica load it, and weighed by routing against "
        "a replica that has it loaded already")

    @field_validator("weight")
    @classmethod
    def _weight_positive(cls, v: float | str) -> float | str:
        if isinstance(v, float | int) and v <= 0:
            raise ValueError("weight must be > 0 (or auto)")
        return v


class Aging(Strict):
    enabled: bool = True
    ceiling: str = Field(
        default="api",
        description="highest class aging may promote into; the strict realtime band stays "
        "reserved for realtime traffic unless set to it",
    )


class ImageTokens(Strict):
    """How many prompt tokens an image counts for admission and fair shares, from its size as
    its header gives it (docs/reference/http-api.md, "Images and audio"). ``patches`` is Qwen2-VL /
    Qwen2.5-VL's count in vLLM: the image is resized to multiples of ``patch_px`` (14 px
    patches merged 2x2) with its pixels kept between ``min_tokens`` and ``max_tokens`` such
    squares, one token each. ``tiles`` is OpenAI's: ``base_tokens`` plus ``tile_tokens`` per
    ``tile_px`` tile once scaled to fit 2048 px and then to 768 px on its short side
    (``detail: low``: ``base_tokens`` alone). ``fixed`` is ``tokens_per_image`` whatever the
    size (LLaVA-1.5: 576)."""

    rule: Literal["patches", "tiles", "fixed"] = "patches"
    patch_px: int = Field(default=28, ge=1)
    min_tokens: int = Field(default=4, ge=1)
    max_tokens: int = Field(default=16_384, ge=1)
    tile_px: int = Field(default=512, ge=1)
    tile_tokens: int = Field(default=170, ge=0)
    base_tokens: int = Field(default=85, ge=0)
    tokens_per_image: int = Field(default=576, ge=0)
    unknown_tokens: int | None = Field(
        default=None, ge=0, description="an image whose size the gateway does not read (an "
        "http(s) URL, which the engine fetches, or a format it does not know); None = what a "
        "1024x1024 image counts by the rule")

    @model_validator(mode="after")
    def _bounds_ok(self) -> ImageTokens:
        if self.min_tokens > self.max_tokens:
            raise ValueError("images.min_tokens must not be over images.max_tokens")
        return self


class AudioTokens(Strict):
    """How many prompt tokens an audio clip counts, from its duration (WAV and MP3 headers):
    Whisper-style encoders as Qwen2-Audio's give 25 tokens a second."""

    tokens_per_second: float = Field(default=25.0, gt=0)
    unknown_tokens: int | None = Field(
        default=None, ge=0, description="a clip whose length the gateway does not read (a URL "
        "or another format); None = 30 seconds' worth")


class Admission(Strict):
    max_queue_total: int = Field(default=100_000, ge=1)
    max_prompt_tokens: int = Field(default=131_072, ge=1)
    max_output_tokens: int = Field(default=32_768, ge=1)
    min_retry_after_s: float = Field(default=1.0, ge=0)
    max_retry_after_s: float = Field(default=60.0, gt=0)
    book_retries: bool = Field(
        default=False, description="a refusal's Retry-After books room for the request's "
        "return (known by a digest of its tenant and body): the room is kept until then, and "
        "returns are spread at the rate the class's queue drains (core/bookings.py). Off: "
        "Retry-After is the forecast time until room, a forecast and not a promise")
    quantile: float = Field(
        default=0.95, gt=0, lt=1, description="deadline admission admits a request when its "
        "time to first token is forecast within its class's budget with this probability: the "
        "forecast is multiplied by this quantile of the actual-to-forecast ratio of the class's "
        "recent admitted requests")
    images: ImageTokens = ImageTokens()
    audio: AudioTokens = AudioTokens()


class Retries(Strict):
    """Retry before the first byte: a budget as Envoy's (a share of the active requests, with a
    floor) and a cap on attempts per request."""

    max_attempts: int = Field(default=3, ge=1, description="dispatches per request at most")
    max_moves: int = Field(
        default=2, ge=0, description="times a stream whose replica failed after its first byte "
        "(died, hung, broke the stream) continues on another replica from the last token "
        "delivered, at most; 0: it ends with an error event, as before")
    budget_percent: float = Field(default=20.0, ge=0, le=100)
    min_retries: int = Field(default=3, ge=0, description="retries allowed whatever the budget")


class Preemption(Strict):
    """Bounds on evicting a running stream for a more urgent request (classes with ``resume``)."""

    min_run_s: float = Field(
        default=2.0, ge=0, description="a stream resumed (or started) this recently is not "
        "evicted again: each eviction costs a recompute, and a stream evicted at once after "
        "each resume would make no progress")
    max_evictions: int = Field(
        default=3, ge=0, description="evictions per request at most; after that it runs to "
        "its end where it is")


class Outlier(Strict):
    """Outlier detection (Envoy's defaults): eject a replica after consecutive failures before
    the first byte, for base x ejections so far, capped, with a little seeded jitter."""

    enabled: bool = True
    consecutive_failures: int = Field(default=5, ge=1)
    base_ejection_s: float = Field(default=30.0, gt=0)
    max_ejection_s: float = Field(default=300.0, gt=0)
    jitter: float = Field(default=0.1, ge=0, le=1)


class Window(Strict):
    """How much each replica may hold in flight (``core.windows.AdaptiveWindow``). ``adaptive``
    starts at ``initial`` and follows the engine's own signals (its queue, KV use, preemptions)
    and, if ``latency_target_s`` is set, its dispatch-to-first-token time, between ``min`` and
    the replica's ``max_window``; ``fixed`` is the ``max_window``, always."""

    mode: Literal["adaptive", "fixed"] = "adaptive"
    initial: int = Field(default=8, ge=1)
    min: int = Field(default=1, ge=1)
    kv_target: float = Field(default=0.9, gt=0, le=1)
    waiting_allowance: float = Field(
        default=0.05, ge=0, description="requests queued inside the engine per window slot "
        "tolerated before the window shrinks"
    )
    shrink: float = Field(default=0.8, gt=0, lt=1)
    grow_frac: float = Field(default=0.1, gt=0)
    settle_s: float = Field(default=2.0, ge=0)
    cooldown_s: float = Field(default=2.0, ge=0)
    latency_target_s: float | None = Field(default=None, gt=0)
    stale_s: float = Field(default=5.0, gt=0, description="signals older than this are ignored "
                           "by the window and count as saturated for routing")
    overtake: bool = Field(
        default=True, description="on a replica whose engine runs its queue in the order sent "
        "(vLLM or SGLang priority scheduling, in-process engines), a request that arrives while "
        "the window is full may go past it, once for each request of this gateway waiting "
        "there unstarted that it would run before: it waits in the engine's queue ahead of them "
        "rather than in qosgate's behind them")


class CacheRouting(Strict):
    """Where a request is cheapest: prefix-cache affinity and sessions (routers ``cache-aware``
    and ``session-affinity``)."""

    session_header: str = Field(
        default="x-session-id", min_length=1, description="the request header that names a "
        "conversation: its turns stick to one replica while it is healthy and not overloaded")
    session_from_user: bool = Field(
        default=False, description="also take OpenAI's `user` field as the session when the "
        "header is absent (opt-in: `user` often names a person, not a conversation)")
    replica_cache_tokens: int = Field(
        default=1_000_000, ge=1, description="an estimate of each replica's prefix cache, in "
        "tokens: the approximate index of the blocks a replica holds (learned from where "
        "requests were sent) forgets the least recently used beyond it, as the engine evicts")
    prefill_tokens_per_s: float = Field(
        default=20_000.0, gt=0, description="an estimate of a replica's prefill rate: turns "
        "the uncached prompt tokens queued on a replica into seconds (cache-aware's cost, and "
        "whether a strict request's TTFT budget holds on a warm replica)")
    recompute_weight: float = Field(
        default=1.0, ge=0, description="cache-aware's cost counts the prompt's uncached "
        "tokens this many times more than its own wait: prefill a cold replica redoes is work "
        "the fleet's other requests wait behind too, which the request's own TTFT omits")
    decode_load_s: float = Field(
        default=0.5, ge=0, description="seconds cache-aware's cost adds for a replica's whole "
        "window in use (its running decodes and engine queue slow a new prompt down)")
    release_factor: float = Field(
        default=1.5, ge=1, description="load release: a warm replica is passed over (routed "
        "by load alone) once its load exceeds the fleet's mean load by this factor")
    release_slack: float = Field(
        default=0.25, ge=0, description="load release: the share of a window a warm replica "
        "may carry above release_factor x the mean (so an idle fleet still has affinity)")
    warm_wait_s: float = Field(
        default=1.0, ge=0, le=30, description="a request of a class whose TTFT budget is at "
        "least ten times this may wait up to this long (and no longer than the prefill it "
        "saves) for its warm replica while that one is full; past it, it goes anywhere. 0: never")
    session_idle_s: float = Field(
        default=300.0, gt=0, description="a session not seen for this long forgets its replica")
    kv_fill: float | None = Field(
        default=0.95, gt=0, le=1, description="cache-aware sends a request of a class that "
        "is not strict to a replica only while the prompts in flight there, "
        "with this one, fill at most this share of replica_kv_tokens (its KV cache); where "
        "none has room it stays queued here, up to kv_wait_s. An engine whose KV overflows "
        "preempts running sequences and computes their prompts again: work that tips a fleet "
        "near capacity into collapse. None: no bound")
    replica_kv_tokens: int | None = Field(
        default=None, ge=1, description="each replica's GPU KV cache in tokens, which its "
        "running sequences hold (kv_fill's bound); None: replica_cache_tokens (set both where "
        "the engine also keeps a host-memory KV tier: the cache is then larger than the KV)")
    kv_wait_s: float = Field(
        default=10.0, ge=0, description="the longest a request waits in the queue for KV room "
        "(kv_fill) before it goes to a replica anyway")


class Fleet(Strict):
    router: Literal["least-load", "least-load-spread", "most-free", "cache-aware",
                    "session-affinity"] = Field(
        default="least-load", description="how a replica is picked: least-load (measured "
        "load), least-load-spread (that, and strict requests spread over the replicas and "
        "steered off one slower than their TPOT budget), most-free (the most free slots), "
        "cache-aware (where the prompt's prefix is cached, weighed in time against load, with "
        "a load release; fleet.cache) or session-affinity (least-load, and a session's turns "
        "stick to one replica while it is not overloaded)")
    window: Window = Window()
    cache: CacheRouting = CacheRouting()
    prefill_budget_tokens: int | None = Field(
        default=2048, ge=1, description="while a replica streams to a strict (realtime) "
        "request, the prompt tokens it has been sent and not yet answered stay within this "
        "budget, so each engine step carries little prefill next to the realtime decode; past "
        "it one prompt of the other classes at a time may go (no starvation). Several gateways "
        "feeding one engine each keep their share of it (what they have in flight over what "
        "the engine holds, from its scrape). None = no bound")
    strict_prompt_hold: bool = Field(
        default=False, description="while a strict (realtime) request's prompt waits on a "
        "replica for its first token, that replica takes no new request of the other classes "
        "(they wait in qosgate's queue, not elsewhere): an engine fills each step's token "
        "budget with whatever is waiting, so their prompts would share realtime's prefill "
        "steps and lengthen them. Helps a pool of one GPU type; costs a fleet that mixes GPU "
        "generations (docs/experiments/tpot-guard.md). Not under fifo")
    tpot_guard: Annotated[float, Field(gt=0)] | Literal["auto"] | None = Field(
        default=None, description="while a replica streams to a strict (realtime) class, "
        "an engine inter-token latency (its mean between two scrapes, from "
        "vllm:inter_token_latency_seconds) past this fraction of that class's TPOT budget holds "
        "the other classes' new requests from that replica until it is back under 3/4 of that "
        "point. auto = a fraction per replica between 0.5 and 1.5, learned from the TPOT its "
        "strict streams got: it starts at 1.5 and tightens only while they miss their budget "
        "(core.tpot_guard.LearnedGuard). None = off (the default: docs/experiments/tpot-guard.md)")
    retries: Retries = Retries()
    outlier: Outlier = Outlier()
    cooldown_s: float = Field(
        default=1.0, gt=0, description="cooling of a replica that answered 429/503 without "
        "Retry-After"
    )
    seed: int = Field(default=0, description="seeds the ejection jitter (deterministic runs)")


class QosConfig(Strict):
    policy: PolicyName = "qos"
    classes: tuple[ServiceClass, ...]
    tiers: tuple[Tier, ...]
    tenants: tuple[Tenant, ...] = ()
    default_tenant: str = "default"
    default_class: str = "api"
    task_types: dict[str, str] = Field(default_factory=dict)
    fairness: Fairness = Fairness()
    models: tuple[ModelSpec, ...] = Field(
        default=(), description="what each model costs (see ModelSpec); unlisted models cost "
        "what the reference model does")
    aging: Aging = Aging()
    admission: Admission = Admission()
    fleet: Fleet = Fleet()
    preemption: Preemption = Preemption()

    @field_validator("classes")
    @classmethod
    def _classes_ok(cls, v: tuple[ServiceClass, ...]) -> tuple[ServiceClass, ...]:
        if not v:
            raise ValueError("at least one service class is needed")
        names = [c.name for c in v]
        if len(set(names)) != len(names):
            raise ValueError(f"class names must be unique, got {names}")
        levels = sorted(c.level for c in v)
        if levels != list(range(len(v))):
            raise ValueError(f"class levels must be 0..{len(v) - 1} once each, got {levels}")
        return tuple(sorted(v, key=lambda c: c.level))

    @model_validator(mode="after")
    def _references_ok(self) -> QosConfig:
        classes = {c.name for c in self.classes}
        tiers = {t.name for t in self.tiers}

        def need_class(name: str | None, where: str) -> None:
            if name is not None and name not in classes:
                raise ValueError(f"{where}: unknown class {name!r} (known: {sorted(classes)})")

        model_names = [m.name for m in self.models]
        if len(set(model_names)) != len(model_names):
            raise ValueError(f"model names must be unique, got {model_names}")
        for m in self.models:
            if m.base is not None and m.base not in model_names:
                raise ValueError(f"model {m.name!r}: base {m.base!r} is not in models")
            if m.base is not None and m.base == m.name:
                raise ValueError(f"model {m.name!r} cannot be its own base")
        ref = self.fairness.reference_model
        if ref is not None and ref not in model_names:
            raise ValueError(f"fairness.reference_model: {ref!r} is not in models")
        need_class(self.default_class, "default_class")
        need_class(self.aging.ceiling, "aging.ceiling")
        for task, cls_name in self.task_types.items():
            need_class(cls_name, f"task_types.{task}")
        keys: set[str] = set()
        names: set[str] = set()
        for t in self.tenants:
            if t.name in names:
                raise ValueError(f"tenant {t.name!r} is defined twice")
            names.add(t.name)
            if t.tier not in tiers:
                raise ValueError(
                    f"tenant {t.name!r}: unknown tier {t.tier!r} (known: {sorted(tiers)})"
                )
            need_class(t.default_class, f"tenant {t.name!r} default_class")
            for c in t.allowed_classes or ():
                need_class(c, f"tenant {t.name!r} allowed_classes")
            for k in t.api_keys:
                if k in keys:
                    raise ValueError(f"api key of tenant {t.name!r} is used by another tenant")
                keys.add(k)
        return self

    def class_named(self, name: str) -> ServiceClass:
        for c in self.classes:
            if c.name == name:
                return c
        raise KeyError(name)


def _default_classes() -> tuple[ServiceClass, ...]:
    # Budgets: the brief says a chat reply late by 2 s hurts and a summary 30 s late is fine; the
    # mission asks a paying user's chat to answer within a second.
    return (
        ServiceClass(
            name="realtime",
            level=0,
            strict=True,
            ttft_budget_ms=1_000,
            tpot_budget_ms=200,
            queue_timeout_s=10,
            max_queue=2_000,
            deadline_admission=True,
            can_preempt=True,
            reserved_share=0.1,
        ),
        ServiceClass(
            name="api",
            level=1,
            weight=5,
            ttft_budget_ms=5_000,
            tpot_budget_ms=200,
            queue_timeout_s=60,
            max_queue=10_000,
            aging_after_s=10,
        ),
        ServiceClass(
            name="batch",
            level=2,
            weight=3,
            ttft_budget_ms=30_000,
            tpot_budget_ms=1000,
            queue_timeout_s=600,
            max_queue=40_000,
            aging_after_s=30,
            preemptible=True,
            resume=True,
        ),
        ServiceClass(
            name="offline",
            level=3,
            weight=2,
            ttft_budget_ms=300_000,
            tpot_budget_ms=1000,
            queue_timeout_s=3_600,
            max_queue=100_000,
            aging_after_s=60,
            preemptible=True,
            resume=True,
        ),
    )


def _default_tiers() -> tuple[Tier, ...]:
    return (
        Tier(name="enterprise", boost=-1),
        Tier(name="pro", boost=0),
        Tier(name="free", boost=1),
        Tier(name="vip", boost=-1),
        Tier(name="standard", boost=0),
        Tier(name="basic", boost=1),
    )


DEFAULT_TASK_TYPES = {
    "chat": "realtime",
    "code_generation": "api",
    "completion": "api",
    "summarize": "batch",
    "translate": "batch",
    "batch_inference": "offline",
    "data_augmentation": "offline",
    "analysis": "offline",
}


def default_config(**overrides: Any) -> QosConfig:
    """The zero-config defaults (seed values), with top-level fields overridable."""
    base: dict[str, Any] = {
        "classes": _default_classes(),
        "tiers": _default_tiers(),
        "task_types": dict(DEFAULT_TASK_TYPES),
    }
    base.update(overrides)
    return QosConfig.model_validate(base)


class ConfigError(ValueError):
    """A config file that cannot be used, with a message a person can act on."""


M = TypeVar("M", bound=BaseModel)


def validated(
    model: type[M], data: Any, what: str, error: type[ValueError] = ConfigError
) -> M:
    """``data`` as a ``model``; a failure becomes one ``error`` listing each bad field by its
    path, which is what a person editing the YAML needs (pydantic's own text is for developers)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        lines = []
        for err in exc.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg']}")
        raise error(f"invalid {what}:\n" + "\n".join(lines)) from None


def read_yaml_mapping(
    path: str | Path, what: str = "config", error: type[ValueError] = ConfigError
) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (an empty file is an empty mapping)."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise error(f"cannot read {what} {p}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise error(f"{what} {p} is not valid YAML: {exc}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise error(f"{what} {p}: the top level must be a mapping")
    return raw


def config_from_mapping(data: dict[str, Any]) -> QosConfig:
    """Missing sections fall back to the defaults: a file that only lists tenants is valid."""
    merged: dict[str, Any] = {
        "classes": [c.model_dump() for c in _default_classes()],
        "tiers": [t.model_dump() for t in _default_tiers()],
        "task_types": dict(DEFAULT_TASK_TYPES),
    }
    merged.update(data)
    return validated(QosConfig, merged, "qosgate config")


def load_config(path: str | Path) -> QosConfig:
    return config_from_mapping(qos_sections(read_yaml_mapping(path)))


IO_SECTIONS = ("server", "upstreams", "engine", "embeddings", "redis", "batches", "request_log")


def qos_sections(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A config file's QoS sections: all but the I/O layers' own (``IO_SECTIONS``, which
    ``settings.py`` validates), so that a misspelt key is an error rather than ignored."""
    return {k: v for k, v in raw.items() if k not in IO_SECTIONS}


def io_sections(raw: Mapping[str, Any]) -> dict[str, Any]:
    """A config file's I/O sections (``settings.GatewaySettings``), those left empty omitted."""
    return {k: raw[k] for k in IO_SECTIONS if raw.get(k) is not None}
