"""A completion or embeddings request, from its headers and body to what the driver is handed
(``prepare``, ``prepare_embeddings``): a ``Prepared`` request, or the ``Refusal`` its client gets.

Every rule a request meets before it queues is here, once: the body (400), the model (404, or
503 while an engine has not answered yet), the engines' own checks of the body (400), the QoS
hints (the ``x-qos-class`` / ``x-qos-priority`` headers win over the body's members; class names
are case-insensitive; a priority header that is no integer is a 400), the conversation it
belongs to (the session header, else with ``session_from_user`` the body's ``user``), the
prompt's prefix keys, the classification (``Scheduler.make_request``), the configured size
limits (the core's ``over_limit``: the same rule admission applies, said with the member at
fault), and the output ceiling written into the body.

No ASGI, no asyncio, no I/O: the headers, the body and the ``Rules`` (the configuration, the
scheduler's classifier, what the engines last said they serve) in, a value out, so each rule is
tested with a header and a body (``RequestFlow`` dispatches, waits and answers). The prompt's
token keys, where the replicas publish their KV events, take an engine's tokenizer: the flow
asks for them after ``prepare`` and puts them in place of the text's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import msgspec

from qosgate.config import QosConfig
from qosgate.core import QosInputError, QosInputs, Request, Scheduler
from qosgate.core.admission import OverLimit, output_over, over_limit
from qosgate.server.auth import RequestHeaders, input_param, session_id, session_message
from qosgate.server.errors import TEXT_ESTIMATE, over_limit_message
from qosgate.settings import GatewaySettings
from qosgate.wire.embeddings import BadEmbeddings, parse_embeddings
from qosgate.wire.engine_request import EngineRequest, Route, Unservable
from qosgate.wire.parse import (
    BadBody,
    Body,
    estimate_how,
    estimate_prompt_tokens,
    parse_body,
    user_of,
)
from qosgate.wire.prefix import body_prefix
from qosgate.wire.retry_key import retry_key
from qosgate.wire.splice import set_member

NO_CLASS = "none"  # the class of a request refused before it had one


class BodyCheck(Protocol):
    """What ``prepare`` asks of an engine (``runtime.ports.Engine`` is one)."""

    @property
    def ready(self) -> bool: ...

    def models(self) -> list[str]: ...

    def check_body(self, body: bytes, route: Route) -> Unservable | None: ...


class Rules:
    """What a request is held against, the same for every request: the configuration, the
    scheduler (its classifier and pricing; ``prepare`` queues nothing), and what the engines
    serve (their models, each model's context length, their own checks of a body)."""

    __slots__ = ("admission", "cfg", "class_names", "context", "embeddings", "engines",
                 "models", "retry_s", "scheduler", "session_from_user", "session_header")

    def __init__(
        self,
        cfg: QosConfig,
        settings: GatewaySettings,
        scheduler: Scheduler,
        engines: Mapping[str, BodyCheck],
        models: Callable[[], list[str]],
        context: Callable[[str], int | None],
        retry_s: float,
    ) -> None:
        self.cfg = cfg
        self.admission = cfg.admission
        self.embeddings = settings.embeddings
        self.scheduler = scheduler
        self.engines = engines
        self.models = models  # the model ids served
        self.context = context  # a model's context length, as its engines report it
        self.retry_s = retry_s  # the Retry-After of a model no engine has answered for yet
        # class names as clients may write them (x-qos-class: Realtime)
        self.class_names = {c.name.lower(): c.name for c in cfg.classes}
        cache = cfg.fleet.cache
        self.session_header = cache.session_header.lower()
        self.session_from_user = cache.session_from_user


@dataclass(frozen=True, slots=True)
class Refusal:
    """The answer to a request refused before it queued: ``reason`` (the error's code), what
    the client is told (``message``, else the reason's own; ``param``, the member or header at
    fault), the class it had by then, and a ``retry_after`` for a refusal that passes."""

    reason: str
    message: str | None = None
    param: str | None = None
    service_class: str = NO_CLASS
    retry_after: float | None = None


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready for the driver: the core's request, the engine request (its body with any
    output ceiling the gateway wrote in), and that ceiling (None: the body is the client's)."""

    req: Request
    engine_request: EngineRequest
    inserted: int | None = None


def prepare(
    heads: RequestHeaders, body: bytes, route: Route, rid: str, now: float, rules: Rules
) -> Prepared | Refusal:
    """A completion (``route``: chat or completions) as the driver takes it, or its refusal."""
    try:
        b = parse_body(body, route, rules.admission)
    except BadBody as exc:
        return Refusal(exc.code, str(exc), exc.param)
    if b.stream_options is not None and not b.stream:
        # what vLLM and OpenAI refuse, refused alike for every engine (the built-in ones do
        # not read stream_options)
        return Refusal("invalid_body", "Stream options can only be defined when `stream=True`.",
                       "stream_options")
    model = _served_model(b.model, body, route, rules)
    if isinstance(model, Refusal):
        return model
    inputs = qos_inputs(heads, b.qos_class, b.priority if isinstance(b.priority, int) else None,
                        b.task_type, b.latency_budget_ms, rules)
    if isinstance(inputs, Refusal):
        return inputs
    session = _session(heads, b, rules)
    if isinstance(session, Refusal):
        return session
    # the output cap as the engine reads it: the Responses API's max_output_tokens, else
    # max_completion_tokens (OpenAI's newer name) first; none stays none (the engine's own
    # default: vLLM's is the rest of the context)
    asked = _output_cap(b, route)
    prompt_tokens = estimate_prompt_tokens(b)
    sched = rules.scheduler
    # the prompt's keys, from its text (only for a router that reads them: hashing a long
    # prompt is not free)
    prefix = body_prefix(b) if sched.reads_prefix else None
    try:
        req = sched.make_request(rid, inputs, now, prompt_tokens, asked, model,
                                 context=rules.context(model), prefix=prefix, session=session)
    except QosInputError as exc:
        return Refusal(exc.code, exc.message, input_param(exc, heads.qos_class))
    req.retry_key = retry_key(req.tenant, body)
    refusal = _size_refusal(b, req, route, rules)
    if refusal is not None:
        return refusal
    inserted = None
    if asked is None and req.ceiling is not None:
        body, asked = _with_ceiling(body, b, req.ceiling, route), req.ceiling
        inserted = asked
    engine_request = EngineRequest(
        rid=rid, route=route, body=body, stream=bool(b.stream), model=model, max_tokens=asked,
        prompt_tokens=prompt_tokens,
        include_usage=bool(b.stream_options and b.stream_options.include_usage),
        has_priority=b.priority is not msgspec.UNSET,
        first_byte_timeout_s=rules.cfg.classes[req.class_level].first_byte_timeout,
    )
    return Prepared(req, engine_request, inserted)


def prepare_embeddings(
    heads: RequestHeaders, body: bytes, rid: str, now: float, rules: Rules
) -> Prepared | Refusal:
    """``POST /v1/embeddings`` as the driver takes it (classified, admitted and queued as a
    completion is; once dispatched, batched by its replica), or its refusal."""
    es = rules.embeddings
    try:
        b = parse_embeddings(body, es.max_inputs, es.max_input_tokens)
    except BadEmbeddings as exc:
        return Refusal(exc.code, str(exc), exc.param)
    models: dict[str, None] = {}
    for e in rules.engines.values():
        if getattr(e, "embeds", False):
            for m in e.models():
                models.setdefault(m, None)
    model = b.model if b.model is not None else next(iter(models), "")
    if model not in models:
        return Refusal("model_not_found", f"The model `{model}` does not serve embeddings "
                       "here. Embedding models: " + (", ".join(models) or "none") + ".", "model")
    inputs = qos_inputs(heads, b.qos_class, b.priority, b.task_type, b.latency_budget_ms, rules)
    if isinstance(inputs, Refusal):
        return inputs
    try:
        req = rules.scheduler.make_request(rid, inputs, now, b.tokens, 1, model)
    except QosInputError as exc:
        return Refusal(exc.code, exc.message, input_param(exc, heads.qos_class))
    req.retry_key = retry_key(req.tenant, body)
    over = over_limit(req, rules.admission)
    if over is not None:
        return _over_limit(over, req, "input", "The input", "text " + TEXT_ESTIMATE)
    engine_request = EngineRequest(
        rid=rid, route="embeddings", body=body, stream=False, model=model, max_tokens=1,
        prompt_tokens=b.tokens, has_priority=b.has_priority,
        first_byte_timeout_s=rules.cfg.classes[req.class_level].first_byte_timeout,
        inputs=b.inputs, encoding_format=b.encoding_format, dimensions=b.dimensions, user=b.user,
    )
    return Prepared(req, engine_request)


def _served_model(name: str | None, body: bytes, route: Route, rules: Rules) -> str | Refusal:
    """The model a completion asks for (none: the first served), if it is served and every
    engine could serve the body."""
    models = rules.models()
    model = name if name is not None else (models[0] if models else "")
    if model not in models:
        if any(not e.ready and not e.models() for e in rules.engines.values()):
            # an engine that has not answered yet may serve it: not a permanent 404
            return Refusal("model_unavailable", retry_after=rules.retry_s)
        return Refusal("model_not_found", f"The model `{model}` does not exist. Served "
                       "models: " + (", ".join(models) or "none") + ".")
    for eng in rules.engines.values():
        problem = eng.check_body(body, route)
        if problem is not None:
            return Refusal("invalid_body", problem.message, problem.param)
    return model


def _output_cap(b: Body, route: Route) -> int | None:
    if route == "responses":
        return b.max_output_tokens
    return b.max_completion_tokens if b.max_completion_tokens is not None else b.max_tokens


# the member holding each route's prompt, named in a refusal of its size
_PROMPT_MEMBER = {"chat": "messages", "completions": "prompt", "responses": "input"}


def _size_refusal(b: Body, req: Request, route: Route, rules: Rules) -> Refusal | None:
    """A completion past a configured size limit (the core's rule), said of the member at
    fault: each output member the client sent (the one the engine does not read too), then the
    prompt."""
    for name, v in (("max_output_tokens", b.max_output_tokens),
                    ("max_completion_tokens", b.max_completion_tokens),
                    ("max_tokens", b.max_tokens)):
        over = output_over(v, req, rules.admission) if v is not None else None
        if over is not None:
            return _over_limit(over, req, name, name)
    over = over_limit(req, rules.admission)
    if over is not None:
        return _over_limit(over, req, _PROMPT_MEMBER.get(route, "prompt"), "The prompt",
                           estimate_how(b))
    return None


def _with_ceiling(body: bytes, b: Body, ceiling: int, route: Route) -> bytes:
    """``body`` capped at a configured ceiling, the only cap the gateway adds (the response
    says so): into the member the client named (null), else the route's own (max_tokens,
    or the Responses API's max_output_tokens), never beside another."""
    if route == "responses":
        return set_member(body, "max_output_tokens", ceiling, b.has_max_output_tokens)
    if b.has_max_completion_tokens:
        return set_member(body, "max_completion_tokens", ceiling, True)
    return set_member(body, "max_tokens", ceiling, b.has_max_tokens)


def qos_inputs(
    heads: RequestHeaders, qos_class: str | None, priority: int | None, task_type: str | None,
    latency_budget_ms: float | None, rules: Rules,
) -> QosInputs | Refusal:
    """What a request tells the classifier: its key, and the class and priority it asks for,
    where the headers win over the body's members (``qos_class``, ``priority``) and class
    names are case-insensitive; a priority header that is not an integer is refused."""
    if heads.qos_class is not None:
        qos_class = heads.qos_class.decode("latin-1").strip()
    if qos_class is not None:
        qos_class = rules.class_names.get(qos_class.lower(), qos_class)
    if heads.qos_priority is not None:
        try:
            priority = int(heads.qos_priority)
        except ValueError:
            return Refusal("invalid_priority", "x-qos-priority must be an integer.",
                           "x-qos-priority")
    return QosInputs(api_key=heads.api_key, qos_class=qos_class, priority=priority,
                     task_type=task_type, latency_budget_ms=latency_budget_ms,
                     batch_line=heads.batch_line)


def _session(heads: RequestHeaders, b: Body, rules: Rules) -> str | Refusal | None:
    """The conversation a request belongs to: its session header (refused if it is not a
    session id), else, with ``session_from_user``, its body's ``user``; None: none."""
    if heads.session is not None:
        session = session_id(heads.session)
        if session is None:
            name = rules.session_header
            return Refusal("invalid_session", session_message(name), name)
        return session
    if rules.session_from_user:
        user = user_of(b)
        return session_id(user) if user is not None else None
    return None


def _over_limit(
    over: OverLimit, req: Request, param: str, subject: str, how: str = TEXT_ESTIMATE
) -> Refusal:
    """The core's refusal by a size limit, said of ``param`` (``subject`` in the message)."""
    return Refusal(over.reason, over_limit_message(over, subject, req.service_class, how), param,
                   req.service_class)
