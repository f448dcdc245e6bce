"""``over_limit``: the configured size limits, one rule for admission and for the gateway's
refusal before it queues; its ``OverLimit`` says the value, the limit and whose it is."""

from __future__ import annotations

from qosgate.config import Admission, Tenant, TenantLimits, default_config
from qosgate.core import QosInputs, Scheduler, State
from qosgate.core.admission import OverLimit, output_over, over_limit

LIMITS = Admission(max_prompt_tokens=1000, max_output_tokens=500)
CFG = default_config(
    admission=LIMITS,
    tenants=(Tenant(name="acme", api_keys=("sk-acme",)),
             Tenant(name="tight", api_keys=("sk-tight",),
                    limits=TenantLimits(max_output_tokens=20))),
)


def test_the_prompt_first_then_the_output_cap() -> None:
    s = Scheduler(CFG)
    both = s.make_request("r", QosInputs(api_key="sk-acme"), 0.0, 1001, 501)
    assert over_limit(both, LIMITS) == OverLimit("prompt_too_long", 1001, 1000)
    out = s.make_request("o", QosInputs(api_key="sk-acme"), 0.0, 10, 501)
    assert over_limit(out, LIMITS) == OverLimit("invalid_max_tokens", 501, 500)
    within = s.make_request("ok", QosInputs(api_key="sk-acme"), 0.0, 1000, 500)
    assert over_limit(within, LIMITS) is None


def test_a_lower_ceiling_is_the_limit_and_says_so() -> None:
    s = Scheduler(CFG)
    req = s.make_request("r", QosInputs(api_key="sk-tight"), 0.0, 10, 21)
    assert over_limit(req, LIMITS) == OverLimit("invalid_max_tokens", 21, 20, True)
    assert output_over(20, req, LIMITS) is None and output_over(0, req, LIMITS) is not None


def test_admission_refuses_by_the_same_rule() -> None:
    s = Scheduler(CFG)
    req = s.make_request("r", QosInputs(api_key="sk-tight"), 0.0, 10, 21)
    s.submit(req, 0.0)
    assert req.state is State.REJECTED and req.reason == "invalid_max_tokens"
