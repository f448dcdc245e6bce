"""Model weight: a token of each model priced in reference-model tokens, in every cost the core
reckons (fair share, admission's estimates, settlement), and each tenant's use per model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from qosgate.config import ModelSpec, Tenant, default_config
from qosgate.core import ReplicaSpec, Scheduler, State
from qosgate.core.weights import ModelWeights
from tests.support.scheduler import Harness

HEAVY = ModelSpec(name="heavy", weight=8.0)
LIGHT = ModelSpec(name="light")


def test_an_unlisted_model_costs_what_the_reference_does() -> None:
    w = ModelWeights([LIGHT, HEAVY])
    assert w.reference == "light"
    assert (w.of("light").prompt, w.of("light").output) == (1.0, 1.0)
    assert (w.of("other").prompt, w.of("other").output) == (1.0, 1.0)
    assert (w.of("heavy").prompt, w.of("heavy").output) == (8.0, 8.0)
    assert w.of("heavy").source == "configured"


def test_prompt_and_output_weights_apart() -> None:
    w = ModelWeights([LIGHT, ModelSpec(name="big", weight=4.0, output_weight=10.0)])
    assert (w.of("big").prompt, w.of("big").output) == (4.0, 10.0)


def test_an_adapter_costs_its_base_and_its_load() -> None:
    w = ModelWeights([LIGHT, HEAVY, ModelSpec(name="sql", base="heavy", load_cost=300.0)])
    assert w.base_of("sql") == "heavy"
    assert w.of("sql").output == 8.0
    assert w.load_cost("sql") == 300.0 and w.load_cost("heavy") == 0.0
    # an adapter given a weight of its own (the compute its matrices add) has that
    own = ModelWeights([LIGHT, HEAVY, ModelSpec(name="sql", base="heavy", weight=9.0)])
    assert own.of("sql").output == 9.0 and own.base_of("sql") == "heavy"


def test_auto_learns_against_the_reference_and_is_one_until_both_are_measured() -> None:
    w = ModelWeights([LIGHT, ModelSpec(name="big", weight="auto")])
    assert w.of("big").output == 1.0 and w.of("big").source == "unmeasured"
    w.measured("big", 0.002, 0.02)
    assert w.of("big").output == 1.0  # the reference is not measured yet
    w.measured("light", 0.0002, 0.002)
    assert w.of("big").prompt == pytest.approx(10.0)
    assert w.of("big").output == pytest.approx(10.0)
    assert w.of("big").source == "learned"
    # later measurements move it gradually (an EWMA), never by one scrape
    w.measured("big", 0.004, 0.04)
    assert 10.0 < w.of("big").output < 20.0


def test_config_rejects_unknown_base_and_reference() -> None:
    with pytest.raises(ValidationError, match="base 'nope'"):
        default_config(models=[{"name": "a", "base": "nope"}])
    with pytest.raises(ValidationError, match="reference_model"):
        default_config(models=[{"name": "a"}], fairness={"reference_model": "b"})
    with pytest.raises(ValidationError, match="weight must be > 0"):
        default_config(models=[{"name": "a", "weight": 0}])


def _harness(**cfg: object) -> Harness:
    return Harness(Scheduler(default_config(**cfg), "qos", [ReplicaSpec("r0", 1)]))


def test_the_charge_and_usage_of_a_heavy_model_are_its_weight_times_the_tokens() -> None:
    h = _harness(models=[LIGHT, HEAVY],
                 tenants=[Tenant(name="a", api_keys=("ka",)), Tenant(name="b", api_keys=("kb",))])
    heavy = h.submit("api", "ka", prompt=100, output=10, model="heavy")
    light = h.submit("api", "kb", prompt=100, output=10, model="light")
    h.run_until(30)
    assert heavy.state is State.COMPLETED and light.state is State.COMPLETED
    rows = {(u.tenant, u.model): u for u in h.sched.usage.rows()}
    # fairness weights 1 (prompt) and 2 (output): 100 + 2 x 10 reference tokens, times 8
    assert rows[("a", "heavy")].charged == pytest.approx(8 * 120)
    assert rows[("b", "light")].charged == pytest.approx(120)
    assert (rows[("a", "heavy")].prompt_tokens, rows[("a", "heavy")].output_tokens) == (100, 10)
    assert rows[("a", "heavy")].requests == 1


def test_fair_share_serves_a_light_tenant_more_tokens_than_a_heavy_one() -> None:
    """Two tenants of one class, both always backlogged on one slot: with the heavy model at
    weight 4, the light tenant gets about four requests for each heavy one (equal charge)."""
    h = _harness(models=[LIGHT, ModelSpec(name="heavy", weight=4.0)],
                 tenants=[Tenant(name="a", api_keys=("ka",)), Tenant(name="b", api_keys=("kb",))])
    for _ in range(40):
        h.submit("batch", "ka", prompt=50, output=20, model="heavy")
        h.submit("batch", "kb", prompt=50, output=20, model="light")
    h.run_until(6.0)  # both still backlogged
    done = {(u.tenant, u.model): u for u in h.sched.usage.rows()}
    heavy_n = done[("a", "heavy")].requests
    light_n = done[("b", "light")].requests
    assert heavy_n >= 3
    assert light_n / heavy_n == pytest.approx(4.0, rel=0.3)
    charged_a, charged_b = done[("a", "heavy")].charged, done[("b", "light")].charged
    assert min(charged_a, charged_b) / max(charged_a, charged_b) > 0.75


@settings(max_examples=40, derandomize=True, deadline=None)
@given(prompt=st.integers(0, 4000), output=st.integers(0, 2000),
       weight=st.floats(0.1, 50.0), out_weight=st.floats(0.1, 50.0))
def test_price_scales_linearly_in_the_models_weights(prompt: int, output: int, weight: float,
                                                      out_weight: float) -> None:
    """The promise: a model's cost is the reference cost of the same tokens with each kind
    times its weight, whatever the numbers; an unlisted model pays the reference price."""
    from qosgate.core.pricing import Pricing

    cfg = default_config(models=[LIGHT, ModelSpec(name="m", weight=weight,
                                                  output_weight=out_weight)])
    p = Pricing(cfg, list(cfg.classes))
    ref = p.used(prompt, output, True, "light")
    assert ref == p.used(prompt, output, True, "unlisted") == p.used(prompt, output, True)
    assert p.used(prompt, output, True, "m") == pytest.approx(
        cfg.fairness.prompt_weight * weight * prompt + cfg.fairness.output_weight * out_weight
        * output)
    assert p.prompt_cost(prompt, "m") == pytest.approx(cfg.fairness.prompt_weight * weight
                                                        * prompt)


def test_the_scheduler_learns_an_auto_weight_from_the_engines_time_per_token() -> None:
    """Each replica serves one model; its scrape's inter-token latency over the sequences
    sharing each step is that model's accelerator time per token."""
    from qosgate.core.signals import LoadSignals

    cfg = default_config(models=[LIGHT, ModelSpec(name="big", weight="auto")])
    sched = Scheduler(cfg, "qos", [ReplicaSpec("r0", 4, models=("light",)),
                                   ReplicaSpec("r1", 4, models=("big",))])
    for name, step in (("r0", 0.01), ("r1", 0.05)):
        sched.observe(name, 0.0, signals=LoadSignals(at=0.0, running=4, itl_seconds_total=0.0,
                                                     itl_tokens_total=0))
        sched.observe(name, 1.0, signals=LoadSignals(at=1.0, running=4,
                                                     itl_seconds_total=step * 100,
                                                     itl_tokens_total=100))
    w = sched.pricing.weights.of("big")
    assert w.source == "learned"
    assert (w.prompt, w.output) == (pytest.approx(5.0), pytest.approx(5.0))


def test_time_per_unit_is_each_models_engine_seconds_over_its_reference_cost() -> None:
    from qosgate.core.weights import time_per_unit

    before = (("heavy", 10.0, 100, 50), ("light", 2.0, 100, 50))
    now = (("heavy", 30.0, 200, 100), ("light", 4.0, 300, 150), ("new", 1.0, 0, 0))
    got = dict(time_per_unit(before, now, 1.0, 2.0))
    assert got["heavy"] == pytest.approx(20.0 / (100 + 2 * 50))
    assert got["light"] == pytest.approx(2.0 / (200 + 2 * 100))
    assert "new" not in got  # no tokens: nothing to learn
    # an engine that restarted reads lower totals: nothing is learned from it
    assert time_per_unit(now, before, 1.0, 2.0) == []


def test_the_scheduler_learns_weights_from_an_engine_that_accounts_time_per_model() -> None:
    """One replica serving both models: its per-model totals teach each model's weight, so
    the charge follows the engine time (which a replica of one model's ITL could not say)."""
    from qosgate.core.signals import LoadSignals

    cfg = default_config(models=[LIGHT, ModelSpec(name="big", weight="auto")])
    sched = Scheduler(cfg, "qos", [ReplicaSpec("r0", 8, models=("light", "big"))])
    sched.observe("r0", 0.0, signals=LoadSignals(
        at=0.0, model_time=(("big", 0.0, 0, 0), ("light", 0.0, 0, 0))))
    sched.observe("r0", 1.0, signals=LoadSignals(
        at=1.0, model_time=(("big", 0.6, 100, 50), ("light", 0.3, 400, 200))))
    w = sched.pricing.weights.of("big")
    # big: 0.6 s over 200 units; light: 0.3 s over 800 units -> 8x
    assert w.source == "learned" and w.output == pytest.approx(8.0)
