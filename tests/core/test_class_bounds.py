"""A tenant can never lift its own class: what it may not use is refused or clamped, never a way
to a better class than what it may use gets."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qosgate.config import Tenant, Tier, default_config
from qosgate.core import Classifier, QosInputError, QosInputs

CLASSES = ("realtime", "api", "batch", "offline")  # the default classes, by level
LEVEL = {name: level for level, name in enumerate(CLASSES)}
PRIORITIES = range(-1, len(CLASSES) + 1)


def _classifier(boost: int, allowed: tuple[str, ...], default: str | None) -> Classifier:
    return Classifier(default_config(
        tiers=(Tier(name="tier", boost=boost),),
        tenants=(Tenant(name="t", tier="tier", api_keys=("k",), default_class=default,
                        allowed_classes=allowed),),
    ))


def test_the_free_tier_asking_for_realtime_is_refused_naming_its_classes() -> None:
    # the README's free tier: asking for realtime got api, asking for api got batch
    c = _classifier(1, ("api", "batch", "offline"), None)
    with pytest.raises(QosInputError) as exc:
        c.classify(QosInputs("k", qos_class="realtime"))
    assert (exc.value.code, exc.value.param) == ("class_not_allowed", "qos_class")
    assert exc.value.message == (
        "This API key's tenant may not use class 'realtime'; its classes are api, batch, "
        "offline.")
    assert c.classify(QosInputs("k", qos_class="api")).service_class == "batch"
    assert c.classify(QosInputs("k")).service_class == "batch"


def test_a_priority_above_the_allowed_classes_gets_what_the_best_allowed_class_gets() -> None:
    c = _classifier(1, ("api", "batch", "offline"), None)
    out = c.classify(QosInputs("k", priority=0))
    assert (out.service_class, out.requested_class) == ("batch", "realtime")
    assert c.classify(QosInputs("k", task_type="chat")).service_class == "batch"
    assert c.classify(QosInputs("k", latency_budget_ms=100)).service_class == "batch"


def test_a_batch_line_is_clamped_and_not_boosted() -> None:
    enterprise = _classifier(-1, ("realtime", "api", "batch", "offline"), None)
    line = enterprise.classify(QosInputs("k", qos_class="batch", batch_line=True))
    assert line.service_class == "batch"
    assert enterprise.classify(QosInputs("k", qos_class="batch")).service_class == "api"
    # a job created before its tenant lost the class still runs, at the nearest allowed one
    narrowed = _classifier(0, ("batch", "offline"), None)
    assert narrowed.classify(QosInputs("k", qos_class="api", batch_line=True)).service_class \
        == "batch"


@settings(max_examples=400, deadline=None)
@given(
    boost=st.integers(-len(CLASSES), len(CLASSES)),
    allowed=st.integers(1, 2 ** len(CLASSES) - 1).map(  # a non-empty subset, as a bit mask
        lambda mask: tuple(n for i, n in enumerate(CLASSES) if mask >> i & 1)),
    default=st.none() | st.sampled_from(CLASSES),
)
def test_asking_for_more_never_yields_more(
    boost: int, allowed: tuple[str, ...], default: str | None
) -> None:
    """Over tier boosts, allowed sets and tenant defaults, every way of asking (each class by
    name, each priority, nothing at all):

    - a class named outside ``allowed`` is refused (``class_not_allowed``), and nothing else is;
    - bounded: every answer is an allowed class, and never better (a lower level) than the best
      answer to a request naming an allowed class: asking for what the tenant may not use never
      gets it more than asking for what it may;
    - monotone: of two answered requests, the one asking for less (a higher level) never gets a
      better class than the one asking for more.
    """
    c = _classifier(boost, allowed, default)
    tenant_default = default or "api"
    asks: list[tuple[int, QosInputs]] = [(LEVEL[tenant_default], QosInputs("k"))]
    asks += [(min(max(p, 0), len(CLASSES) - 1), QosInputs("k", priority=p)) for p in PRIORITIES]
    for name in CLASSES:
        inputs = QosInputs("k", qos_class=name)
        if name in allowed:
            asks.append((LEVEL[name], inputs))
            continue
        with pytest.raises(QosInputError) as exc:
            c.classify(inputs)
        assert exc.value.code == "class_not_allowed"
        assert exc.value.message.endswith(", ".join(allowed) + ".")
    answers = [(asked, LEVEL[c.classify(inputs).service_class]) for asked, inputs in asks]
    best_allowed = min(LEVEL[c.classify(QosInputs("k", qos_class=n)).service_class]
                       for n in allowed)
    for _, got in answers:
        assert CLASSES[got] in allowed
        assert got >= best_allowed
    for asked_more, got_more in answers:
        for asked_less, got_less in answers:
            if asked_less > asked_more:
                assert got_less >= got_more
