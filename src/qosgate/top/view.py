"""``qosgate top``: a live terminal view of one gateway or several, from their own HTTP APIs.

It reads only what an operator can read from outside (``GET /v1/qos/status`` and ``GET /metrics``
with the admin key), so it works against any running gateway, local or remote, and shows exactly
what Prometheus would scrape. The view is built by pure functions from the scraped data
(:func:`frame`), so that the tests check the rendering from canned scrapes; ``fetch.run`` is
the fetch loop around them.

Rates need two scrapes: TTFT quantiles and outcome counts are computed over the interval since the
previous scrape *of the same instance* (several ``--workers`` behind one URL answer in turn, and
each counts only its own requests), and are cumulative since the instance started on the first
frame (always with ``--once``); the frame says which.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich import box
from rich.console import Group, RenderableType
from rich.text import Text

from qosgate.tables import FitTable

# sample name -> [(labels, value)]
Samples = dict[str, list[tuple[dict[str, str], float]]]

OUTCOMES = ("completed", "rejected", "timed_out", "failed", "cancelled")
OUTCOME_HEADS = ("done", "rejected", "timeout", "failed", "cancel")


@dataclass
class Scrape:
    """What one URL answered at one moment (``at`` is ``time.monotonic()``)."""

    url: str
    at: float
    status: dict[str, Any] | None = None
    status_error: str | None = None
    metrics: Samples | None = None
    metrics_error: str | None = None

    @property
    def answered(self) -> bool:
        return self.status is not None or self.metrics is not None

    @property
    def instance(self) -> str | None:
        """The instance that answered /metrics (else /v1/qos/status): the key of its counters."""
        if self.metrics is not None:
            for labels, _ in self.metrics.get("qosgate_instance_info", []):
                if "instance" in labels:
                    return labels["instance"]
        if self.status is not None and isinstance(self.status.get("instance"), str):
            return str(self.status["instance"])
        return None

    @property
    def key(self) -> str:
        return f"{self.url}#{self.instance}"


# ---------------------------------------------------------------- parsing and arithmetic
def parse_metrics(text: str) -> Samples:
    """Prometheus text exposition -> samples by sample name (``..._total``, ``..._bucket``)."""
    out: Samples = defaultdict(list)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return dict(out)


def _series(samples: Samples | None, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    if samples is None:
        return {}
    return {tuple(sorted(lab.items())): v for lab, v in samples.get(name, [])}


def increase(cur: Samples, prev: Samples | None, name: str
             ) -> list[tuple[dict[str, str], float]]:
    """Per series, what a counter grew by since ``prev`` (all of it if ``prev`` is None, if the
    series is new, or if it went down: the instance restarted), as Prometheus's ``increase``."""
    before = _series(prev, name) if prev is not None else {}
    out = []
    for key, v in _series(cur, name).items():
        old = before.get(key, 0.0)
        out.append((dict(key), v - old if v >= old else v))
    return out


def histogram_quantile(q: float, buckets: Iterable[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile``: ``buckets`` are (upper bound, cumulative count),
    linear inside the bucket; None with no observations; the highest finite bound if the
    quantile falls in +Inf."""
    bs = sorted(buckets)
    if not bs or bs[-1][1] <= 0:
        return None
    rank = q * bs[-1][1]
    lower, below = 0.0, 0.0
    for upper, count in bs:
        if count >= rank:
            if math.isinf(upper):
                return lower
            if count == below:
                return upper
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    return lower


def _buckets_by(rows: Iterable[tuple[dict[str, str], float]], label: str
                ) -> dict[str, dict[float, float]]:
    out: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for lab, v in rows:
        if label in lab and "le" in lab:
            out[lab[label]][float(lab["le"])] += v
    return out


# ---------------------------------------------------------------- formatting
def fmt_s(v: float | None) -> str:
    """A duration without spaces (the plain frame splits on whitespace in scripts)."""
    if v is None:
        return "-"
    if v < 1:
        return f"{v * 1000:.0f}ms"
    if v < 100:
        return f"{v:.1f}s"
    return f"{v:.0f}s"


def _n(v: float) -> str:
    return f"{v:.0f}"


def _count(total: float, in_span: float | None) -> str:
    """Cumulative, or ``+in_span/total`` once a previous scrape gives an interval."""
    if in_span is None or total == 0:
        return _n(total)
    return f"+{_n(in_span)}/{_n(total)}"


def get_in(d: Mapping[str, Any] | None, *path: str) -> Any:
    """``d[path[0]][path[1]]...``, or None where a step is missing or not a mapping."""
    cur: Any = d
    for p in path:
        if not isinstance(cur, Mapping):
            return None
        cur = cur.get(p)
    return cur


# ---------------------------------------------------------------- the frame
@dataclass
class Span:
    """How the frame's rates were computed: over ``seconds`` (the interval between two scrapes
    of each instance), or cumulative since each instance started (``seconds`` None)."""

    seconds: float | None
    prev: dict[str, Samples | None] = field(default_factory=dict)  # scrape key -> its previous

    @property
    def label(self) -> str:
        if self.seconds is None:
            return "since start (cumulative: first frame)"
        return f"over the last {self.seconds:.1f}s (between two scrapes)"


def span_of(scrapes: list[Scrape], previous: Mapping[str, Scrape]) -> Span:
    """Rates over the last interval if every instance that answered /metrics was scraped
    before, else cumulative for all (mixing the two in one sum would mean nothing)."""
    live = [s for s in scrapes if s.metrics is not None]
    if not live or any(s.key not in previous for s in live):
        return Span(None)
    spans = [s.at - previous[s.key].at for s in live]
    return Span(max(spans), {s.key: previous[s.key].metrics for s in live})


def _outcomes(scrapes: list[Scrape], span: Span, by: str
              ) -> tuple[dict[tuple[str, str], float], dict[tuple[str, str], float]]:
    """(total, in the span) per (``by`` label, outcome) from ``qosgate_requests_total``."""
    total: dict[tuple[str, str], float] = defaultdict(float)
    in_span: dict[tuple[str, str], float] = defaultdict(float)
    for s in scrapes:
        if s.metrics is None:
            continue
        for lab, v in s.metrics.get("qosgate_requests_total", []):
            total[(lab.get(by, "?"), lab.get("outcome", "?"))] += v
        if span.seconds is not None:
            for lab, v in increase(s.metrics, span.prev.get(s.key), "qosgate_requests_total"):
                in_span[(lab.get(by, "?"), lab.get("outcome", "?"))] += v
    return total, in_span


def _quantiles(scrapes: list[Scrape], span: Span, name: str, by: str
               ) -> dict[str, tuple[float | None, float | None, float]]:
    """(p50, p99, observations) per ``by`` label of histogram ``name``, summed over instances."""
    merged: dict[str, dict[float, float]] = defaultdict(lambda: defaultdict(float))
    for s in scrapes:
        if s.metrics is None:
            continue
        if span.seconds is None:
            rows = s.metrics.get(name + "_bucket", [])
        else:
            rows = increase(s.metrics, span.prev.get(s.key), name + "_bucket")
        for k, bs in _buckets_by(rows, by).items():
            for le, v in bs.items():
                merged[k][le] += v
    out = {}
    for k, bs in merged.items():
        items = list(bs.items())
        n = max((v for _, v in items), default=0.0)
        out[k] = (histogram_quantile(0.5, items), histogram_quantile(0.99, items), n)
    return out


def _table(title: str, *cols: str, keys: int = 1) -> FitTable:
    """Names left, numbers right, never cut: too wide for the terminal, the table continues
    below with the ``keys`` name columns repeated."""
    return FitTable(title, [(c, "left" if i < keys else "right") for i, c in enumerate(cols)],
                    keys, dict(title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                               show_edge=False, title_style="bold"))


def _state(s: Scrape) -> Text:
    if not s.answered:
        refused = (s.status_error or "").startswith("HTTP ")
        return Text("REFUSED" if refused else "UNREACHABLE", style="bold red")
    if s.status_error or s.metrics_error:
        return Text("no status" if s.status_error else "no metrics", style="yellow")
    if s.status is not None and not s.status.get("accepting", True):
        return Text("draining", style="yellow")
    return Text("ok", style="green")


def instances_table(scrapes: list[Scrape]) -> RenderableType:
    """One row per URL: who answered (or why nothing did, in full below the table), and the
    shared-state store it uses."""
    t = _table("gateways", "url", "instance", "state", "policy", "queued", "inflight",
               "free slots", "shared state")
    errors: list[Text] = []
    for s in scrapes:
        st = s.status
        if not s.answered and s.status_error == s.metrics_error:
            errors.append(Text(f"  {s.url}: {s.status_error}", style="red"))
        else:
            errors += [Text(f"  {s.url} {what}: {e}", style="red") for what, e in
                       (("/v1/qos/status", s.status_error), ("/metrics", s.metrics_error)) if e]
        shared = get_in(st, "shared_state") or {}
        if shared.get("store") == "redis":
            sh = (f"redis, {shared.get('live_instances', '?')} live"
                  + (", DEGRADED" if shared.get("degraded") else ""))
        else:
            sh = str(shared.get("store", "-"))
        who = get_in(st, "instance")
        mine = s.instance
        if who is None:
            who = mine or "-"
        elif mine is not None and mine != who:  # two workers behind one port answered
            who = f"{who} (metrics: {mine})"
        t.add_row(s.url, str(who), _state(s), str(get_in(st, "policy") or "-"),
                  _fmt_opt(get_in(st, "queued_total")), _fmt_opt(_inflight_total(st)),
                  _fmt_opt(get_in(st, "free_slots")), sh)
    return Group(t, *errors) if errors else t


def _inflight_total(st: Mapping[str, Any] | None) -> int | None:
    classes = get_in(st, "classes")
    if not isinstance(classes, Mapping):
        return None
    return sum(int(c.get("inflight", 0)) for c in classes.values())


def _fmt_opt(v: Any) -> str:
    return "-" if v is None else str(v)


def fleet_table(scrapes: list[Scrape]) -> FitTable | None:
    """The instances sharing state through Redis, as the answering ones last synced them: with
    ``--workers N`` behind one port, how to see the workers the URL did not route to."""
    fleet: dict[str, tuple[dict[str, Any], str]] = {}
    for s in scrapes:
        for inst, info in (get_in(s.status, "shared_state", "fleet") or {}).items():
            fleet.setdefault(inst, (info if isinstance(info, dict) else {}, s.url))
    if not fleet:
        return None
    answering = {s.instance for s in scrapes} | {get_in(s.status, "instance") for s in scrapes}
    t = _table("fleet (shared state, as last synced)", "instance", "queued", "inflight",
               "seen via", "answered this frame")
    for inst, (info, url) in sorted(fleet.items()):
        t.add_row(inst, _fmt_opt(info.get("queued_total")), _fmt_opt(info.get("inflight")),
                  url, "yes" if inst in answering else "")
    return t


def batches_table(scrapes: list[Scrape], now: datetime) -> FitTable | None:
    """Batch jobs not ended (``/v1/qos/status``'s ``batches``): their progress and the lines
    each gateway has in flight for them; None when there are none."""
    jobs: dict[str, dict[str, Any]] = {}
    for s in scrapes:
        for j in get_in(s.status, "batches") or []:
            if not isinstance(j, Mapping) or "id" not in j:
                continue
            seen = jobs.setdefault(str(j["id"]), dict(j, in_flight=0))
            seen["in_flight"] += int(j.get("in_flight", 0))
    if not jobs:
        return None
    t = _table("batch jobs", "job", "tenant", "class", "status", "done", "failed", "total",
               "in flight", "deadline in")
    at = now.timestamp()
    for jid, j in sorted(jobs.items(), key=lambda kv: kv[1].get("expires_at", 0)):
        left = float(j.get("expires_at", at)) - at
        t.add_row(jid, str(j.get("tenant", "")), str(j.get("class", "")),
                  str(j.get("status", "")), _n(float(j.get("completed", 0))),
                  _n(float(j.get("failed", 0))), _n(float(j.get("total", 0))),
                  str(j["in_flight"]), fmt_s(max(left, 0.0)))
    return t


def classes_table(scrapes: list[Scrape], span: Span) -> FitTable:
    """Per class, summed over the gateways: queue, wait, TTFT and outcomes."""
    queued: dict[str, int] = defaultdict(int)
    inflight: dict[str, int] = defaultdict(int)
    oldest: dict[str, float] = defaultdict(float)
    order: list[str] = []
    for s in scrapes:
        for name, c in (get_in(s.status, "classes") or {}).items():
            if name not in order:
                order.append(name)
            queued[name] += int(c.get("queued", 0))
            inflight[name] += int(c.get("inflight", 0))
            oldest[name] = max(oldest[name], float(c.get("oldest_wait_s", 0.0)))
    ttft = _quantiles(scrapes, span, "qosgate_ttft_seconds", "class")
    total, in_span = _outcomes(scrapes, span, "class")
    for cls in [*ttft, *(k for k, _ in total)]:
        if cls not in order:
            order.append(cls)
    t = _table("classes" + ("" if span.seconds is None else "  (outcomes: +in window/total)"),
               "class", "queued", "inflight", "oldest", "TTFT p50", "TTFT p99", "n",
               *OUTCOME_HEADS)
    for cls in order:
        p50, p99, n = ttft.get(cls, (None, None, 0.0))
        known = cls in queued
        t.add_row(
            cls, str(queued[cls]) if known else "-", str(inflight[cls]) if known else "-",
            fmt_s(oldest[cls]) if known and queued[cls] else "-", fmt_s(p50), fmt_s(p99), _n(n),
            *(_outcome_cell(total, in_span, span, cls, o) for o in OUTCOMES),
        )
    return t


def _outcome_cell(total: Mapping[tuple[str, str], float], in_span: Mapping[tuple[str, str], float],
                  span: Span, who: str, outcome: str) -> Text:
    tot = total.get((who, outcome), 0.0)
    d = None if span.seconds is None else in_span.get((who, outcome), 0.0)
    style = ""
    if outcome in ("rejected", "timed_out", "failed") and (d if d is not None else tot) > 0:
        style = "red"
    return Text(_count(tot, d), style=style)


def tenants_table(scrapes: list[Scrape], span: Span) -> FitTable:
    """Per tenant: its queue (status; an admin key sees every tenant) and its outcomes (metrics:
    tenants past ``server.metrics_max_tenants`` count as ``other``)."""
    queued: dict[str, int] = defaultdict(int)
    inflight: dict[str, int] = defaultdict(int)
    classes: dict[str, set[str]] = defaultdict(set)
    for s in scrapes:
        for name, tt in (get_in(s.status, "tenants") or {}).items():
            queued[name] += int(tt.get("queued", 0))
            inflight[name] += int(tt.get("inflight", 0))
            classes[name].update(tt.get("classes", {}))
    total, in_span = _outcomes(scrapes, span, "tenant")
    names = sorted({*queued, *(k for k, _ in total)})
    t = _table("tenants" + ("" if span.seconds is None else "  (outcomes: +in window/total)"),
               "tenant", "queued", "inflight", "classes now", "done", "rejected", "timeout",
               "failed")
    for name in names:
        t.add_row(name, str(queued[name]), str(inflight[name]),
                  ",".join(sorted(classes[name])) or "-",
                  *(_outcome_cell(total, in_span, span, name, o)
                    for o in ("completed", "rejected", "timed_out", "failed")))
    return t


_Keyed = dict[tuple[str, str, str], float]


def _per_tenant_model(scrapes: list[Scrape], span: Span, name: str) -> tuple[_Keyed, _Keyed]:
    """(total, in the span) per (tenant, model, kind) of the counter ``name``, summed over the
    instances (kind "" where the family has none)."""
    total: _Keyed = defaultdict(float)
    in_span: _Keyed = defaultdict(float)
    for s in scrapes:
        if s.metrics is None:
            continue
        for lab, v in s.metrics.get(name, []):
            total[(lab.get("tenant", "?"), lab.get("model", "?"), lab.get("kind", ""))] += v
        if span.seconds is not None:
            for lab, v in increase(s.metrics, span.prev.get(s.key), name):
                in_span[(lab.get("tenant", "?"), lab.get("model", "?"),
                         lab.get("kind", ""))] += v
    return total, in_span


def models_table(scrapes: list[Scrape], span: Span) -> FitTable | None:
    """Per tenant and model: the tokens it used and what it was charged for them, in
    reference-model tokens (shown where the fleet has more than one model or a weighted one:
    otherwise the charge is the tenants table's tokens times the fairness weights)."""
    tokens, tokens_in = _per_tenant_model(scrapes, span, "qosgate_tenant_model_tokens_total")
    charged, charged_in = _per_tenant_model(scrapes, span, "qosgate_tenant_model_charged_total")
    weighted = any(s.metrics.get("qosgate_model_weight") for s in scrapes
                   if s.metrics is not None)
    pairs = sorted({(t, m) for t, m, _ in tokens} | {(t, m) for t, m, _ in charged})
    if not pairs or (not weighted and len({m for _, m in pairs}) < 2):
        return None
    cut = span.seconds is None
    t = _table("models per tenant" + ("" if cut else "  (+in window/total)"),
               "tenant", "model", "prompt tok", "output tok", "charged (ref tok)", keys=2)
    for tenant, model in pairs:
        t.add_row(tenant, model, *(
            _count(total.get((tenant, model, kind), 0.0),
                   None if cut else in_span.get((tenant, model, kind), 0.0))
            for total, in_span, kind in ((tokens, tokens_in, "prompt"),
                                         (tokens, tokens_in, "output"),
                                         (charged, charged_in, ""))))
    return t


def replicas_table(scrapes: list[Scrape], span: Span) -> FitTable:
    """Per replica as each gateway sees it (breakers and cooling are each gateway's own)."""
    several = len(scrapes) > 1
    cols = ["replica", *(["gateway"] if several else []), "up", "eligible", "breaker",
            "inflight/window", "cooling", "ejections", "retries", "attempt fails",
            "TTFT p50"]
    t = _table("replicas", *cols, keys=2 if several else 1)
    for s in scrapes:
        reps = get_in(s.status, "replicas") or {}
        names = list(reps)
        for lab, _ in (s.metrics or {}).get("qosgate_replica_capacity", []):
            if lab.get("replica") and lab["replica"] not in names:
                names.append(lab["replica"])
        retries, fails = _per_replica(s, span, "qosgate_retries_total"), _per_replica(
            s, span, "qosgate_attempt_failures_total")
        ttft = _quantiles([s], span, "qosgate_replica_ttft_seconds", "replica")
        gauges = {g: {lab.get("replica"): v for lab, v in (s.metrics or {}).get(g, [])}
                  for g in ("qosgate_replica_up", "qosgate_replica_eligible",
                            "qosgate_replica_breaker_open", "qosgate_replica_inflight",
                            "qosgate_replica_capacity", "qosgate_replica_cooling_seconds",
                            "qosgate_replica_ejections_total")}
        for name in names:
            r = reps.get(name, {})
            up = _pick(r, "up", gauges["qosgate_replica_up"], name)
            elig = _pick(r, "eligible", gauges["qosgate_replica_eligible"], name)
            breaker = r.get("breaker")
            if breaker is None and name in gauges["qosgate_replica_breaker_open"]:
                breaker = "open" if gauges["qosgate_replica_breaker_open"][name] else "closed"
            inf = _pick(r, "inflight", gauges["qosgate_replica_inflight"], name)
            cap = _pick(r, "capacity", gauges["qosgate_replica_capacity"], name)
            cool = _pick(r, "cooling_s", gauges["qosgate_replica_cooling_seconds"], name)
            ej = _pick(r, "ejections", gauges["qosgate_replica_ejections_total"], name)
            gw = get_in(s.status, "instance") or s.instance or s.url
            row: list[str | Text] = [name, *([str(gw)] if several else [])]
            row += [
                _yes(up), _yes(elig),
                Text(str(breaker or "-"), style="red" if breaker not in (None, "closed") else ""),
                f"{_fmt_opt(None if inf is None else int(inf))}/"
                f"{_fmt_opt(None if cap is None else int(cap))}",
                fmt_s(float(cool)) if cool else "-",
                _fmt_opt(None if ej is None else int(ej)),
                retries.get(name, "0"), fails.get(name, "0"),
                fmt_s(ttft.get(name, (None, None, 0.0))[0]),
            ]
            t.add_row(*row)
    return t


def _pick(r: Mapping[str, Any], key: str, gauge: Mapping[str | None, float], name: str) -> Any:
    """The status's value (fresher: same request), else the metric's (a tenant key's status
    carries no health)."""
    return r[key] if key in r else gauge.get(name)


def _yes(v: Any) -> Text:
    if v is None:
        return Text("-")
    return Text("yes", style="green") if v else Text("NO", style="bold red")


def _per_replica(s: Scrape, span: Span, name: str) -> dict[str, str]:
    if s.metrics is None:
        return {}
    total: dict[str, float] = defaultdict(float)
    for lab, v in s.metrics.get(name, []):
        total[lab.get("replica", "?")] += v
    in_span: dict[str, float] = defaultdict(float)
    if span.seconds is not None:
        for lab, v in increase(s.metrics, span.prev.get(s.key), name):
            in_span[lab.get("replica", "?")] += v
    return {k: _count(v, None if span.seconds is None else in_span[k]) for k, v in total.items()}


def frame(scrapes: list[Scrape], previous: Mapping[str, Scrape] | None = None,
          now: datetime | None = None) -> RenderableType:
    """The whole view from one round of scrapes (and the previous scrape of each instance, for
    rates over the last interval)."""
    span = span_of(scrapes, previous or {})
    now = now or datetime.now(UTC)
    ok = sum(1 for s in scrapes if s.answered)
    head = Text.assemble(
        ("qosgate top", "bold"),
        f"  {now:%Y-%m-%d %H:%M:%S} UTC  {ok}/{len(scrapes)} gateway(s) answered  "
        f"TTFT, outcomes: {span.label}",
    )
    parts: list[RenderableType] = [head, instances_table(scrapes)]
    fleet = fleet_table(scrapes)
    if fleet is not None:
        parts.append(fleet)
    if ok:
        parts += [classes_table(scrapes, span), tenants_table(scrapes, span)]
        models = models_table(scrapes, span)
        if models is not None:
            parts.append(models)
        parts.append(replicas_table(scrapes, span))
        jobs = batches_table(scrapes, now)
        if jobs is not None:
            parts.append(jobs)
    return Group(*parts)
