"""Every route the gateway serves, in one table: what it does with each, the 404's list of
what is served, and the HTTP reference's table (``docs/reference/http-api.md``, checked against
this one by ``tests/server/test_routes.py``).

A route qosgate does not know is refused (404, OpenAI's error format, naming the routes served),
not passed to an engine: what reaches an engine is what qosgate has authenticated and counted,
and an engine's route that would bypass the schedule (a generation under another path) must not
get through unseen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["scheduled", "passed through", "qosgate's own"]


@dataclass(frozen=True, slots=True)
class Route:
    methods: tuple[str, ...]
    path: str
    kind: Kind
    what: str
    batches: bool = False  # served only with the Batch API on (``batches`` configured)


ROUTES: tuple[Route, ...] = (
    Route(("POST",), "/v1/chat/completions", "scheduled",
          "classified, admitted, queued and counted; the body forwarded as sent (priority set)"),
    Route(("POST",), "/v1/completions", "scheduled", "as chat"),
    Route(("POST",), "/v1/responses", "scheduled",
          "the Responses API, as chat (upstream engines that serve it, such as vLLM)"),
    Route(("POST",), "/v1/embeddings", "scheduled", "as chat, then batched per replica"),
    Route(("POST",), "/tokenize", "passed through",
          "to a ready replica serving the body's model; API key, counted, not queued"),
    Route(("POST",), "/detokenize", "passed through", "as /tokenize"),
    Route(("GET",), "/version", "passed through", "to a ready replica; no key needed"),
    Route(("GET", "POST"), "/ping", "passed through", "to a ready replica; no key needed"),
    Route(("GET",), "/load", "passed through", "to a ready replica; API key"),
    Route(("GET", "HEAD"), "/v1/models", "qosgate's own",
          "the models of the replicas (the engines' own cards); API key"),
    Route(("GET", "HEAD"), "/health", "qosgate's own", "liveness (also /healthz); no key"),
    Route(("GET", "HEAD"), "/healthz", "qosgate's own", "liveness; no key"),
    Route(("GET", "HEAD"), "/readyz", "qosgate's own",
          "readiness: 503 while no engine is ready or while draining; no key"),
    Route(("GET", "HEAD"), "/metrics", "qosgate's own",
          "Prometheus (admin key with server.metrics_auth)"),
    Route(("GET", "HEAD"), "/v1/qos/status", "qosgate's own",
          "queues, tenants, replicas; a tenant key sees its own allowance"),
    Route(("POST",), "/v1/qos/reload", "qosgate's own",
          "reload the config file (admin key), as SIGHUP does"),
    Route(("POST", "GET"), "/v1/files", "qosgate's own", "the Batch API's files", True),
    Route(("GET", "DELETE"), "/v1/files/{id}", "qosgate's own", "one file", True),
    Route(("GET",), "/v1/files/{id}/content", "qosgate's own", "its content", True),
    Route(("POST", "GET"), "/v1/batches", "qosgate's own", "the Batch API's jobs", True),
    Route(("GET",), "/v1/batches/{id}", "qosgate's own", "one job", True),
    Route(("POST",), "/v1/batches/{id}/cancel", "qosgate's own", "cancel it", True),
)

# the fixed paths and the methods they take: another method is a 405 with ``Allow``
METHODS: dict[str, tuple[str, ...]] = {
    r.path: r.methods for r in ROUTES if not r.batches and "{" not in r.path}
PASSED: dict[str, Route] = {r.path: r for r in ROUTES if r.kind == "passed through"}


def served(batches: bool) -> str:
    """The routes served, for the 404 of a route that is not: ``POST /v1/chat/completions,
    ...``."""
    return ", ".join(f"{'/'.join(r.methods)} {r.path}" for r in ROUTES
                     if batches or not r.batches)


def routes_table() -> str:
    """The HTTP reference's table of routes, in Markdown."""
    rows = ["| method | path | qosgate | what it does |", "| --- | --- | --- | --- |"]
    for r in ROUTES:
        what = r.what + (" (with the Batch API on)" if r.batches else "")
        rows.append(f"| {', '.join(r.methods)} | `{r.path}` | {r.kind} | {what} |")
    return "\n".join(rows) + "\n"
