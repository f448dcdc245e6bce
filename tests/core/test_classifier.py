import pytest

from qosgate.config import Tenant, default_config
from qosgate.core import Classifier, QosInputError, QosInputs


def _cfg() -> Classifier:
    return Classifier(
        default_config(
            tenants=(
                Tenant(name="acme", tier="enterprise", api_keys=("k-acme",)),
                Tenant(name="std", tier="standard", api_keys=("k-std",), default_class="batch"),
                Tenant(
                    name="hobby",
                    tier="free",
                    api_keys=("k-hobby",),
                    allowed_classes=("batch", "offline"),
                ),
            )
        )
    )


def test_open_mode_without_tenants() -> None:
    c = Classifier(default_config())
    out = c.classify(QosInputs(api_key=None))
    assert (out.tenant, out.service_class, out.level) == ("default", "api", 1)
    assert out.budget_s == 5.0


def test_unknown_or_missing_key_is_refused_when_tenants_exist() -> None:
    c = _cfg()
    for key in (None, "nope"):
        with pytest.raises(QosInputError) as exc:
            c.classify(QosInputs(api_key=key))
        assert exc.value.code == "invalid_api_key"


def test_precedence_class_over_priority_over_task_over_budget() -> None:
    c = _cfg()
    k = "k-std"
    assert c.classify(QosInputs(k, qos_class="offline", priority=0)).service_class == "offline"
    assert c.classify(QosInputs(k, priority=0, task_type="batch_inference")).level == 0
    assert c.classify(QosInputs(k, task_type="chat", latency_budget_ms=1e6)).level == 0
    # the most relaxed class whose budget meets 6 s is api (5 s); 100 ms fits none: realtime
    assert c.classify(QosInputs(k, latency_budget_ms=6000)).service_class == "api"
    assert c.classify(QosInputs(k, latency_budget_ms=100)).service_class == "realtime"
    assert c.classify(QosInputs(k)).service_class == "batch"  # tenant default


def test_vllm_polarity_smaller_priority_is_more_urgent() -> None:
    c = _cfg()
    levels = [c.classify(QosInputs("k-std", priority=p)).level for p in (-5, 0, 1, 2, 3, 99)]
    assert levels == [0, 0, 1, 2, 3, 3]


def test_tier_boost_and_clamp() -> None:
    c = _cfg()
    assert c.classify(QosInputs("k-acme", qos_class="batch")).service_class == "api"  # -1
    assert c.classify(QosInputs("k-acme", qos_class="realtime")).service_class == "realtime"
    # free tier: a class it may not use is refused; a priority above its classes is clamped into
    # them before the +1, so it gets what naming its best class gets, never more
    with pytest.raises(QosInputError) as exc:
        c.classify(QosInputs("k-hobby", qos_class="realtime"))
    assert exc.value.code == "class_not_allowed"
    out = c.classify(QosInputs("k-hobby", priority=0))
    assert out.service_class == "offline" and out.requested_class == "realtime"
    assert c.classify(QosInputs("k-hobby", qos_class="batch")).service_class == "offline"


def test_explicit_budget_sets_the_deadline() -> None:
    c = _cfg()
    assert c.classify(QosInputs("k-std", qos_class="batch", latency_budget_ms=250)).budget_s == 0.25


@pytest.mark.parametrize(
    ("inputs", "code"),
    [
        (QosInputs("k-std", qos_class="gold"), "unknown_class"),
        (QosInputs("k-std", task_type="poetry"), "unknown_task_type"),
        (QosInputs("k-std", latency_budget_ms=0), "invalid_latency_budget"),
        (QosInputs("k-std", latency_budget_ms=-3), "invalid_latency_budget"),
    ],
)
def test_bad_inputs(inputs: QosInputs, code: str) -> None:
    with pytest.raises(QosInputError) as exc:
        _cfg().classify(inputs)
    assert exc.value.code == code
