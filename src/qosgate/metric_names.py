"""Every ``qosgate_*`` metric family the gateway exports, in one place: name, type, unit, labels
and help text.

The code that emits metrics builds its families from these entries (``Family.counter``,
``.gauge``, ``.histogram``): ``server/metrics.py``, ``server/protocol.py`` and
``runtime/shared_state.py``. It sits at the top of the package, beside ``config.py``, so that
every layer that emits or reads metrics (``runtime``, ``server``, ``top/``) can import it.
``tests/e2e/test_metric_names.py`` checks that a live gateway's ``/metrics`` carries
exactly these families, types, labels and help texts; ``tests/test_metric_names.py`` that the
Grafana board (``deploy/grafana/qosgate.json``), the Prometheus rules (``deploy/prometheus/``),
``top/`` and the docs name only what is registered here.

Naming follows Prometheus' conventions: base units (``_seconds``), the unit before the type
suffix, counters exposed with ``_total`` (``name`` below is the exposition name), histograms as
``_bucket``/``_count``/``_sum`` (plus ``_created``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True, slots=True)
class Family:
    name: str  # as exposed: counters end in _total
    kind: Kind
    unit: str  # base unit ("seconds", "tokens", "requests", ...); "" when a plain number or 0/1
    labels: tuple[str, ...]
    help: str
    source: str  # the module that emits it

    @property
    def base(self) -> str:
        """The family name as the text format's ``# TYPE`` line and a parser name it (a
        counter's without ``_total``)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name

    def counter(self) -> CounterMetricFamily:
        assert self.kind == "counter", self.name
        return CounterMetricFamily(self.name, self.help, labels=list(self.labels))

    def gauge(self) -> GaugeMetricFamily:
        assert self.kind == "gauge", self.name
        return GaugeMetricFamily(self.name, self.help, labels=list(self.labels))

    def histogram(self) -> HistogramMetricFamily:
        assert self.kind == "histogram", self.name
        return HistogramMetricFamily(self.name, self.help, labels=list(self.labels))


FAMILIES: dict[str, Family] = {}

_METRICS = "qosgate.server.metrics"
_BATCHES = "qosgate.server.metrics (BatchingCollector)"
_SHARED = "qosgate.runtime.shared_state"
_PROTOCOL = "qosgate.server.protocol"


def _f(name: str, kind: Kind, unit: str, labels: tuple[str, ...], help: str,
       source: str = _METRICS) -> Family:
    assert name.startswith("qosgate_") and name not in FAMILIES, name
    assert (kind == "counter") == name.endswith("_total"), name
    if unit:
        assert unit in name, name
    fam = Family(name, kind, unit, labels, help, source)
    FAMILIES[name] = fam
    return fam


C, T = ("class",), ("tenant",)
R = ("replica",)

# ---------------------------------------------------------------- requests and classes
REQUESTS = _f("qosgate_requests_total", "counter", "requests", ("class", "tenant", "outcome",
              "reason"), "Requests by terminal outcome (completed, rejected, timed_out, "
              "cancelled, failed).")
QUEUE_WAIT = _f("qosgate_queue_wait_seconds", "histogram", "seconds", C,
                "Arrival to (last) dispatch.")
TTFT = _f("qosgate_ttft_seconds", "histogram", "seconds", C, "Arrival to first token.")
E2E = _f("qosgate_e2e_seconds", "histogram", "seconds", C,
         "Arrival to completion (completed requests).")
TPOT = _f("qosgate_tpot_seconds", "histogram", "seconds", C,
          "Time per output token after the first (completed requests with 2 tokens or more).")
SLO = _f("qosgate_slo_requests_total", "counter", "requests", ("class", "slo"),
         "Completed requests that met or missed their class's TTFT budget (and TPOT budget "
         "where the class has one); slo: met or missed.")
QUEUE_DEPTH = _f("qosgate_queue_depth", "gauge", "", C, "Queued requests.")
QUEUE_OLDEST = _f("qosgate_queue_oldest_wait_seconds", "gauge", "seconds", C,
                  "Wait of the oldest queued request.")
INFLIGHT = _f("qosgate_inflight", "gauge", "", C, "Requests at an engine.")
PREEMPTIONS = _f("qosgate_preemptions_total", "counter", "", C,
                 "Requests pulled back for a more urgent one.")
EVICTIONS = _f("qosgate_evictions_total", "counter", "", C,
               "Streams pulled back after their first byte for a more urgent request (their "
               "engine call closed; they continue later from the tokens delivered).")
MOVES = _f("qosgate_moves_total", "counter", "", (*C, "reason"),
           "Streams continued on another replica after theirs failed mid-stream (reason: how "
           "it failed).")
RESUMES = _f("qosgate_resumes_total", "counter", "", C,
             "Streams continued by a new engine call, after an eviction or a move.")
RESENT_TOKENS = _f("qosgate_resume_prompt_tokens_total", "counter", "tokens", C,
                   "Prompt tokens sent again to continue streams (the prompt and the tokens "
                   "already produced).")
RESENT_CACHED = _f("qosgate_resume_cached_tokens_total", "counter", "tokens", C,
                   "Of the prompt tokens sent again, those the engine took from its prefix "
                   "cache (as its usage said; engines that do not say count none).")
ADMITTED_SEEN = _f("qosgate_admitted_outcomes_total", "counter", "", (*C, "on_time"),
                   "Requests admitted against their class's TTFT budget whose first token came "
                   "(or that ended unanswered past it), on time or not: the share on time is "
                   "admission's calibration, against admission.quantile.")
ADMISSION_FACTOR = _f("qosgate_admission_calibration_factor", "gauge", "", C,
                      "What deadline admission multiplies a TTFT forecast by before comparing "
                      "it with the budget (1: forecasts are trusted as they are).")
RETRY_BOOKINGS = _f("qosgate_retry_bookings_total", "counter", "", ("outcome",),
                    "Refusals whose Retry-After kept room for the request's return "
                    "(outcome: made), and those bookings taken by the return (kept) or left to "
                    "lapse (lapsed).")
CLASS_TTFT_BUDGET = _f("qosgate_class_ttft_budget_seconds", "gauge", "seconds", C,
                       "The class's configured TTFT budget (ttft_budget_ms), for alerts and "
                       "panels to compare against.")
CLASS_STARVATION = _f("qosgate_class_starvation_seconds", "gauge", "seconds", C,
                      "The queue wait past which a request of the class is starving: the time "
                      "aging takes to lift it to the aging ceiling class, plus that class's "
                      "aging_after_s (its TTFT budget when it has none).")

# ---------------------------------------------------------------- tenants
TENANT_QUEUED = _f("qosgate_tenant_queued", "gauge", "", T, "Queued requests.")
TENANT_INFLIGHT = _f("qosgate_tenant_inflight", "gauge", "", T, "Requests at an engine.")
PASSED_THROUGH = _f("qosgate_passthrough_requests_total", "counter", "requests",
                    ("route", "status"),
                    "Utility calls passed through to an engine (/tokenize, /version, ...; not "
                    "scheduled), by route and the status answered.", _METRICS)
CONFIG_RELOADS = _f("qosgate_config_reloads_total", "counter", "", ("outcome",),
                    "Reloads of the config file (SIGHUP or POST /v1/qos/reload): applied, or "
                    "refused with the running config kept.", _METRICS)
TENANT_TOKENS = _f("qosgate_tenant_tokens_total", "counter", "tokens", ("tenant", "kind"),
                   "Tokens served per tenant: kind prompt (requests that got a first token) "
                   "or output (tokens generated, a cancelled stream's so far).")
TENANT_MODEL_TOKENS = _f("qosgate_tenant_model_tokens_total", "counter", "tokens",
                         ("tenant", "model", "kind"),
                         "Tokens a tenant used of a model (kind prompt or output), counted when "
                         "its requests end (model other: one no replica or config names; none: "
                         "the request named none).")
TENANT_MODEL_CHARGED = _f("qosgate_tenant_model_charged_total", "counter", "",
                          ("tenant", "model"),
                          "What fair sharing charged a tenant for a model, in reference-model "
                          "tokens: tokens times the fairness weights times the model's weight "
                          "(cached prompt tokens credited; an adapter's cold load added).")
MODEL_WEIGHT = _f("qosgate_model_weight", "gauge", "", ("model", "kind"),
                  "What one token of a model costs in reference-model tokens (kind prompt or "
                  "output), configured, from engine profiles or learned; models not listed cost "
                  "1.")
FAIRNESS_TOKEN_COST = _f("qosgate_fairness_token_cost", "gauge", "", ("kind",),
                         "What fair sharing (VTC) charges per token of a kind: fairness."
                         "prompt_weight and output_weight of the config; share of service is "
                         "tokens times this.")
TENANT_WEIGHT = _f("qosgate_tenant_weight", "gauge", "", T,
                   "The tenant's configured fair-share weight (other: the sum of the tenants "
                   "without a label of their own).")

# ---------------------------------------------------------------- replicas
REPLICA_INFLIGHT = _f("qosgate_replica_inflight", "gauge", "", R, "Requests in flight.")
REPLICA_CAPACITY = _f("qosgate_replica_capacity", "gauge", "", R,
                      "The window in force: requests the replica may hold in flight.")
REPLICA_UP = _f("qosgate_replica_up", "gauge", "", R, "1 if its last health probe answered.")
REPLICA_ELIGIBLE = _f("qosgate_replica_eligible", "gauge", "", R,
                      "1 if it may take work now (up, not cooling, not ejected).")
REPLICA_BREAKER = _f("qosgate_replica_breaker_open", "gauge", "", R,
                     "1 while outlier detection has it ejected.")
REPLICA_COOLING = _f("qosgate_replica_cooling_seconds", "gauge", "seconds", R,
                     "Back-pressure (429/503 Retry-After) left before it takes work again.")
REPLICA_EJECTIONS = _f("qosgate_replica_ejections_total", "counter", "", R,
                       "Outlier ejections.")
REPLICA_OVERTAKES = _f("qosgate_overtakes_total", "counter", "", R,
                       "Requests sent past a full window to overtake this gateway's unstarted "
                       "work in an engine that runs its queue in the order sent.")
REPLICA_TTFT = _f("qosgate_replica_ttft_seconds", "histogram", "seconds", R,
                  "Dispatch to first token, per replica.")
REPLICA_SIGNALS_AGE = _f("qosgate_replica_signals_age_seconds", "gauge", "seconds", R,
                         "Age of the engine's last scraped load signals (absent when the "
                         "replica has none).")
ENGINE_RUNNING = _f("qosgate_replica_engine_running", "gauge", "", R,
                    "Sequences the engine runs, from its last scraped signals.")
ENGINE_WAITING = _f("qosgate_replica_engine_waiting", "gauge", "", R,
                    "Sequences queued inside the engine, from its last scraped signals.")
ENGINE_KV = _f("qosgate_replica_engine_kv_usage_ratio", "gauge", "ratio", R,
               "The engine's KV cache in use (0-1), from its last scraped signals.")
ENGINE_ITL = _f("qosgate_replica_engine_itl_seconds", "gauge", "seconds", R,
                "The engine's mean time per output token between its last two scrapes "
                "(vllm:inter_token_latency_seconds), which the TPOT guard reads.")
OTHERS_HELD = _f("qosgate_replica_others_held", "gauge", "", R,
                 "1 while the TPOT guard holds the non-strict classes' new requests off it.")
TPOT_GUARD = _f("qosgate_replica_tpot_guard_seconds", "gauge", "seconds", R,
                "The engine time per output token past which the TPOT guard holds it (learned "
                "per replica under tpot_guard: auto; absent when the guard is off).")
REPLICA_PROMPT_TOKENS = _f("qosgate_replica_prompt_tokens_total", "counter", "tokens",
                           ("replica", "kind"),
                           "Prompt tokens of the completed requests whose engine reported its "
                           "prefix cache (vLLM: usage.prompt_tokens_details.cached_tokens): kind "
                           "offered (their prompts) or cached (what the engine took from its "
                           "prefix cache rather than computed).")
ATTEMPT_FAILURES = _f("qosgate_attempt_failures_total", "counter", "", ("class", "replica",
                      "reason"), "Engine calls that failed before the first byte reached the "
                      "client.")
RETRIES = _f("qosgate_retries_total", "counter", "", ("class", "replica", "reason"),
             "Failed attempts retried on another replica.")

# ---------------------------------------------------------------- the gateway itself
CPU = _f("qosgate_process_cpu_seconds_total", "counter", "seconds", (),
         "CPU time of this gateway process (user + system).")
LOOP_LAG = _f("qosgate_event_loop_lag_seconds", "gauge", "seconds", (),
              "Delay of a callback queued on the event loop at the previous scrape: how long "
              "ready work waited for the loop.")
RENDER = _f("qosgate_metrics_render_seconds", "gauge", "seconds", (),
            "Time the previous /metrics render took.")
CONNECTIONS_REFUSED = _f("qosgate_connections_refused_total", "counter", "", ("reason",),
                         "Connections closed before a request reached the gateway: "
                         "too_many_connections, header_timeout, headers_too_large, "
                         "invalid_http.", _PROTOCOL)
OPEN_CONNECTIONS = _f("qosgate_open_connections", "gauge", "", (), "Open client connections.",
                      _PROTOCOL)
INSTANCE_INFO = _f("qosgate_instance_info", "gauge", "", ("instance", "shared_state"),
                   "This gateway instance (1); shared_state: redis or none.", _SHARED)
SHARED_DEGRADED = _f("qosgate_shared_state_degraded", "gauge", "", ("instance",),
                     "1 while the shared-state store is unreachable (local state at each limit "
                     "/ live instances, or limited tenants refused).", _SHARED)
SHARED_LIVE = _f("qosgate_shared_state_live_instances", "gauge", "", ("instance",),
                 "Gateway instances alive in the shared state at the last sync.", _SHARED)
SHARED_SYNCS = _f("qosgate_shared_state_syncs_total", "counter", "", ("instance", "outcome"),
                  "Syncs with the shared state.", _SHARED)

# ---------------------------------------------------------------- embeddings batching
EMB_WINDOW = _f("qosgate_embeddings_batch_window_seconds", "gauge", "seconds", R,
                "The linger in force at a replica: how long a batch waits to fill.", _BATCHES)
EMB_PENDING = _f("qosgate_embeddings_batch_pending", "gauge", "", R,
                 "Embeddings requests waiting in a lingering batch.", _BATCHES)
EMB_BATCHES = _f("qosgate_embeddings_batches_total", "counter", "", ("replica", "reason"),
                 "Batches released, by reason (size, tokens, urgent, full, window).", _BATCHES)
EMB_SIZE = _f("qosgate_embeddings_batch_size", "histogram", "", R,
              "Requests per released batch.", _BATCHES)
EMB_DECISIONS = _f("qosgate_embeddings_window_decisions_total", "counter", "",
                   ("replica", "decision"),
                   "The adaptive linger's evaluations: grow, shrink or hold.", _BATCHES)

# ---------------------------------------------------------------- batch jobs (OpenAI Batch API)
_JOBS = "qosgate.server.metrics (BatchJobsCollector)"
BATCH_JOBS = _f("qosgate_batch_jobs", "gauge", "", ("status",),
                "Batch jobs by status (validating, in_progress, finalizing, cancelling, "
                "completed, failed, expired, cancelled), as the batch store holds them.", _JOBS)
BATCH_LINES = _f("qosgate_batch_lines_total", "counter", "", ("outcome",),
                 "Batch job lines this instance ran, by outcome: completed, failed (final, with "
                 "its error), retried (an engine failure, run again), waited (a refusal that "
                 "asked to wait), expired, cancelled.", _JOBS)
BATCH_IN_FLIGHT = _f("qosgate_batch_lines_in_flight", "gauge", "", (),
                     "Batch job lines this instance has handed to the scheduler, not yet ended.",
                     _JOBS)
BATCH_SPARE = _f("qosgate_batch_spare_slots", "gauge", "", (),
                 "Slots live traffic leaves free for batch jobs: the windows less the recent "
                 "peak of live requests and a headroom.", _JOBS)

_SUFFIXES = ("_bucket", "_count", "_sum", "_created")


def family_of(series: str) -> Family | None:
    """The registered family a series name (as written in PromQL or the text format) belongs
    to: ``qosgate_ttft_seconds_bucket`` -> ``qosgate_ttft_seconds``; ``None`` if none."""
    if series in FAMILIES:
        return FAMILIES[series]
    for suffix in _SUFFIXES:
        stem = series.removesuffix(suffix)
        if stem != series:
            fam = FAMILIES.get(stem)
            if fam is not None and (fam.kind == "histogram" or suffix == "_created"):
                return fam
            fam = FAMILIES.get(stem + "_total") if suffix == "_created" else None
            if fam is not None:
                return fam
    return None
