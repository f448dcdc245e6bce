"""``prepare`` and ``prepare_embeddings`` without a server: headers and a body in, a ``Prepared``
request or the ``Refusal`` its client gets out. Each rule a request meets before it queues: the
model, the engines' own checks, the QoS hints (headers over the body, class names in any case,
a priority header that is no integer), the session and the prefix keys, and the size limits
(the core's ``over_limit``, said with the member at fault and whose ceiling it is)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from qosgate.config import Admission, Fleet, QosConfig, Tenant, TenantLimits, default_config
from qosgate.config import CacheRouting as Cache
from qosgate.core import Scheduler
from qosgate.server.auth import RequestHeaders
from qosgate.server.prepare import (
    NO_CLASS,
    Prepared,
    Refusal,
    Rules,
    prepare,
    prepare_embeddings,
)
from qosgate.settings import GatewaySettings
from qosgate.wire.engine_request import Route, Unservable

MODEL = "m"
HI = [{"role": "user", "content": "hi"}]


class FakeEngine:
    """An engine as ``prepare`` sees it: its readiness, its models and its own body check."""

    def __init__(self, models: list[str], *, ready: bool = True, embeds: bool = False,
                 problem: Unservable | None = None) -> None:
        self._models = models
        self.ready = ready
        self.embeds = embeds
        self.problem = problem

    def models(self) -> list[str]:
        return self._models

    def check_body(self, body: bytes, route: Route) -> Unservable | None:
        return self.problem


def rules(cfg: QosConfig | None = None, *engines: FakeEngine) -> Rules:
    cfg = cfg or default_config(
        tenants=(Tenant(name="acme", api_keys=("sk-acme",)),
                 Tenant(name="tight", api_keys=("sk-tight",),
                        limits=TenantLimits(max_output_tokens=20))),
        admission=Admission(max_prompt_tokens=1000, max_output_tokens=500),
    )
    served = engines or (FakeEngine([MODEL]),)
    table = {f"e{i}": e for i, e in enumerate(served)}

    def models() -> list[str]:
        return [m for e in served for m in e.models()]

    return Rules(cfg, GatewaySettings(), Scheduler(cfg), table, models, lambda _m: 4096, 2.0)


def heads(key: str | None = "sk-acme", cls: bytes | None = None, priority: bytes | None = None,
          session: bytes | None = None) -> RequestHeaders:
    return RequestHeaders(key, cls, priority, session)


def chat(**members: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": HI, **members}).encode()


def ready(got: Prepared | Refusal) -> Prepared:
    assert isinstance(got, Prepared), got
    return got


def refused(got: Prepared | Refusal) -> Refusal:
    assert isinstance(got, Refusal), got
    return got


def test_a_plain_chat_is_prepared_as_asked() -> None:
    p = ready(prepare(heads(), chat(max_tokens=7, stream=True), "chat", "r1", 3.0, rules()))
    assert p.req.id == "r1" and p.req.tenant == "acme" and p.req.arrival == 3.0
    e = p.engine_request
    assert e.model == MODEL and e.max_tokens == 7 and e.stream
    assert p.engine_request.body == chat(max_tokens=7, stream=True) and p.inserted is None


def test_the_model_is_checked() -> None:
    r = refused(prepare(heads(), chat(model="other"), "chat", "r1", 0.0, rules()))
    assert r.reason == "model_not_found" and "`other`" in (r.message or "")
    assert MODEL in (r.message or "") and r.service_class == NO_CLASS
    # no model: the first served one
    assert ready(prepare(heads(), b'{"messages":[{"role":"user","content":"x"}]}', "chat", "r",
                         0.0, rules())).engine_request.model == MODEL


def test_a_model_an_engine_starting_may_serve_is_a_retry_not_a_404() -> None:
    rs = rules(None, FakeEngine([MODEL]), FakeEngine([], ready=False))
    r = refused(prepare(heads(), chat(model="other"), "chat", "r1", 0.0, rs))
    assert r.reason == "model_unavailable" and r.retry_after == 2.0


def test_the_engines_own_check_refuses_with_its_words() -> None:
    rs = rules(None, FakeEngine([MODEL], problem=Unservable("no tools here", "tools")))
    r = refused(prepare(heads(), chat(), "chat", "r1", 0.0, rs))
    assert (r.reason, r.message, r.param) == ("invalid_body", "no tools here", "tools")


def test_a_bad_body_names_its_member() -> None:
    r = refused(prepare(heads(), chat(max_tokens="ten"), "chat", "r1", 0.0, rules()))
    assert r.param == "max_tokens"
    r = refused(prepare(heads(), chat(stream_options={"include_usage": True}), "chat", "r1", 0.0,
                        rules()))
    assert r.reason == "invalid_body" and r.param == "stream_options"


def test_the_class_header_wins_over_the_body_and_names_are_case_insensitive() -> None:
    body = chat(qos_class="batch")
    assert ready(prepare(heads(), body, "chat", "r", 0.0, rules())).req.service_class == "batch"
    p = ready(prepare(heads(cls=b" Realtime "), body, "chat", "r", 0.0, rules()))
    assert p.req.service_class == "realtime"
    p = ready(prepare(heads(), chat(qos_class="OFFLINE"), "chat", "r", 0.0, rules()))
    assert p.req.service_class == "offline"


def test_the_priority_header_wins_over_the_body() -> None:
    body = chat(priority=5)
    assert ready(prepare(heads(), body, "chat", "r", 0.0, rules())).engine_request.has_priority
    assert refused(prepare(heads(priority=b"x"), body, "chat", "r", 0.0, rules())) == Refusal(
        "invalid_priority", "x-qos-priority must be an integer.", "x-qos-priority")


def test_an_unknown_class_names_the_header_it_came_from() -> None:
    r = refused(prepare(heads(cls=b"nope"), chat(), "chat", "r", 0.0, rules()))
    assert r.reason == "unknown_class" and r.param == "x-qos-class"
    r = refused(prepare(heads(), chat(qos_class="nope"), "chat", "r", 0.0, rules()))
    assert r.param == "qos_class"


def test_the_session_header_or_the_user() -> None:
    p = ready(prepare(heads(session=b" conv-1 "), chat(user="u"), "chat", "r", 0.0, rules()))
    assert p.req.session == "conv-1"
    r = refused(prepare(heads(session=b"\x01"), chat(), "chat", "r", 0.0, rules()))
    assert r.reason == "invalid_session" and r.param == "x-session-id"
    # the user stands for the session only where the configuration says so
    assert ready(prepare(heads(), chat(user="u"), "chat", "r", 0.0, rules())).req.session is None
    cfg = default_config(fleet=Fleet(cache=Cache(session_from_user=True)))
    assert ready(prepare(heads(), chat(user="u"), "chat", "r", 0.0, rules(cfg))).req.session == "u"


def test_prefix_keys_only_for_a_router_that_reads_them() -> None:
    long = chat(messages=[{"role": "user", "content": "x" * 2000}])
    assert ready(prepare(heads(), long, "chat", "r", 0.0, rules())).req.prefix is None
    cfg = default_config(fleet=Fleet(router="cache-aware"))
    prefix = ready(prepare(heads(), long, "chat", "r", 0.0, rules(cfg))).req.prefix
    assert prefix is not None and prefix.keys


@pytest.mark.parametrize("member", ["max_tokens", "max_completion_tokens"])
def test_an_output_cap_past_the_limit_is_refused_by_the_core_rule(member: str) -> None:
    r = refused(prepare(heads(), chat(**{member: 9000}), "chat", "r", 0.0, rules()))
    assert (r.reason, r.param, r.service_class) == ("invalid_max_tokens", member, "api")
    assert r.message == f"{member} is 9000; it must be between 1 and 500."
    r = refused(prepare(heads(), chat(**{member: 0}), "chat", "r", 0.0, rules()))
    assert r.param == member


def test_the_member_the_engine_does_not_read_is_checked_too() -> None:
    r = refused(prepare(heads(), chat(max_tokens=10, max_completion_tokens=0), "chat", "r", 0.0,
                        rules()))
    assert r.param == "max_completion_tokens"
    r = refused(prepare(heads(), chat(max_tokens=9000, max_completion_tokens=10), "chat", "r",
                        0.0, rules()))
    assert r.param == "max_tokens"


def test_a_ceiling_is_said_to_be_the_class_or_tenant_one() -> None:
    r = refused(prepare(heads("sk-tight"), chat(max_tokens=21), "chat", "r", 0.0, rules()))
    assert r.message == ("max_tokens is 21; it must be between 1 and 20 (the output ceiling of "
                         "class api or its tenant).")


def test_a_ceiling_is_written_into_the_member_the_client_named() -> None:
    p = ready(prepare(heads("sk-tight"), chat(), "chat", "r", 0.0, rules()))
    assert p.inserted == 20 and p.engine_request.max_tokens == 20
    assert json.loads(p.engine_request.body)["max_tokens"] == 20
    p = ready(prepare(heads("sk-tight"), chat(max_completion_tokens=None), "chat", "r", 0.0,
                      rules()))
    sent = json.loads(p.engine_request.body)
    assert sent["max_completion_tokens"] == 20 and "max_tokens" not in sent
    p = ready(prepare(heads("sk-tight"), chat(max_tokens=5), "chat", "r", 0.0, rules()))
    assert p.inserted is None and p.engine_request.max_tokens == 5


def test_a_prompt_past_the_limit_names_the_member_and_how_it_was_counted() -> None:
    body = json.dumps({"model": MODEL, "prompt": "x" * 8000, "max_tokens": 1}).encode()
    r = refused(prepare(heads(), body, "completions", "r", 0.0, rules()))
    assert (r.reason, r.param) == ("prompt_too_long", "prompt")
    assert r.message == ("The prompt is about 2000 tokens (estimated as characters / 4), over "
                         "the limit of 1000 tokens.")
    long = chat(messages=[{"role": "user", "content": "x" * 8000}])
    assert refused(prepare(heads(), long, "chat", "r", 0.0, rules())).param == "messages"


def test_embeddings_share_the_rules() -> None:
    rs = rules(None, FakeEngine([MODEL], embeds=True), FakeEngine(["chat-only"]))
    body = json.dumps({"model": MODEL, "input": ["a", "b"], "qos_class": "batch"}).encode()
    p = ready(prepare_embeddings(heads(cls=b"OFFLINE"), body, "r", 0.0, rs))
    assert p.req.service_class == "offline" and p.engine_request.route == "embeddings"
    assert p.engine_request.inputs == ["a", "b"] and p.engine_request.max_tokens == 1
    r = refused(prepare_embeddings(heads(), body.replace(b'"m"', b'"chat-only"'), "r", 0.0, rs))
    assert (r.reason, r.param) == ("model_not_found", "model")
    r = refused(prepare_embeddings(heads(priority=b"high"), body, "r", 0.0, rs))
    assert r.reason == "invalid_priority"
    long = json.dumps({"model": MODEL, "input": ["x" * 4000, "y" * 4000]}).encode()
    r = refused(prepare_embeddings(heads(), long, "r", 0.0, rs))
    assert (r.reason, r.param) == ("prompt_too_long", "input")
    assert r.message == ("The input is about 2000 tokens (text estimated as characters / 4), "
                         "over the limit of 1000 tokens.")
