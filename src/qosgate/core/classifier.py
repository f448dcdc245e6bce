"""From who asks and what they ask for to a class, a level and a deadline.

Precedence of the request's own QoS inputs: an explicit class name (``x-qos-class`` header or a
``qos_class`` field) > an integer ``priority`` > ``task_type`` > ``latency_budget_ms`` > the
tenant's default class > the global default.

A tenant can never lift itself above what its config allows, and asking for more never gets it
more: a class *named* outside its ``allowed_classes`` is refused (``class_not_allowed``, naming
the allowed ones); a level that came another way (a priority, a task type, a latency budget, a
default) is first clamped into the allowed classes. Then the tenant's tier boost moves it
(enterprise one level up, free one down) and the result is clamped into the allowed classes
again. Both steps keep order, so of two requests the one asking for less never gets more, and
none gets more than naming the best allowed class gets.

A Batch API job's line (``batch_line``) runs at its job's class as it is: no tier boost (the
boost is for interactive latency; a job already waits for free slots), and a class the tenant
lost since the job was created is clamped, not refused.

Integer priorities follow vLLM's polarity (smaller runs first): priority p maps to the class of
level p, clamped to the known levels. (One seed says a larger vLLM ``priority`` runs first; vLLM's
docs and code say "lower value means earlier handling", and that is what qosgate follows.)
"""

from __future__ import annotations

from dataclasses import dataclass

from qosgate.config import QosConfig, Tenant

_MEMO_SIZE = 8192


class QosInputError(ValueError):
    """The request's QoS inputs cannot be used. ``code`` is stable; the gateway maps it to a status
    (``invalid_api_key`` → 401, ``class_not_allowed`` → 403, the rest → 400). ``param`` is the
    body member at fault (the gateway names the header instead when the value came from one)."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param


@dataclass(slots=True, frozen=True)
class QosInputs:
    api_key: str | None = None
    qos_class: str | None = None
    priority: int | None = None
    task_type: str | None = None
    latency_budget_ms: float | None = None
    batch_line: bool = False  # a Batch API job's line: the job's class, unboosted


@dataclass(slots=True, frozen=True)
class Classification:
    tenant: str
    service_class: str
    requested_class: str
    level: int
    budget_s: float  # time from arrival to the first-token deadline


class Classifier:
    def __init__(self, cfg: QosConfig) -> None:
        self.retenant(cfg)

    def retenant(self, cfg: QosConfig) -> None:
        """Classify by ``cfg`` from now (at start, and on a reload: the one object every part
        holds is changed in place)."""
        self.cfg = cfg
        self.open = not cfg.tenants
        self._by_key = {k: t for t in cfg.tenants for k in t.api_keys}
        self._tenants = {t.name: t for t in cfg.tenants}
        self._boost = {t.name: t.boost for t in cfg.tiers}
        self._classes = list(cfg.classes)  # sorted by level
        self._level_of = {c.name: c.level for c in cfg.classes}
        self._memo: dict[tuple[object, ...], Classification] = {}
        self._allowed: dict[str, list[int]] = {
            t.name: sorted(self._level_of[c] for c in t.allowed_classes)
            for t in cfg.tenants
            if t.allowed_classes
        }

    def tenant_for(self, api_key: str | None) -> Tenant | None:
        """The tenant of a key; None in open mode (no tenants configured)."""
        if self.open:
            return None
        tenant = self._by_key.get(api_key or "")
        if tenant is None:
            raise QosInputError(
                "invalid_api_key",
                "Missing API key." if not api_key else "Incorrect API key provided.",
            )
        return tenant

    def classify(self, inputs: QosInputs) -> Classification:
        """Pure in its inputs, so remembered: a gateway sees the same few combinations of key,
        class and priority over and over (bounded; errors are not remembered)."""
        # keyed by the fields' tuple: hashed and compared in C, where the frozen dataclass's
        # own __hash__ and __eq__ are Python calls on every request
        key = (inputs.api_key, inputs.qos_class, inputs.priority, inputs.task_type,
               inputs.latency_budget_ms, inputs.batch_line)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        out = self._classify(inputs)
        if len(self._memo) >= _MEMO_SIZE:
            self._memo.clear()
        self._memo[key] = out
        return out

    def _classify(self, inputs: QosInputs) -> Classification:
        if inputs.latency_budget_ms is not None and not inputs.latency_budget_ms > 0:
            raise QosInputError("invalid_latency_budget", "latency_budget_ms must be > 0.",
                                "latency_budget_ms")
        tenant = self.tenant_for(inputs.api_key)
        tenant_name = tenant.name if tenant else self.cfg.default_tenant
        requested = self._requested_level(inputs, tenant)
        allowed = self._allowed.get(tenant_name)
        level = requested
        if allowed:
            if inputs.qos_class is not None and requested not in allowed and not inputs.batch_line:
                names = ", ".join(self._classes[a].name for a in allowed)
                raise QosInputError(
                    "class_not_allowed",
                    f"This API key's tenant may not use class {inputs.qos_class!r}; its classes "
                    f"are {names}.",
                    "qos_class",
                )
            level = _clamp_to_allowed(level, allowed)
        if tenant is not None and not inputs.batch_line:
            level += self._boost.get(tenant.tier, 0)
            level = min(max(level, 0), len(self._classes) - 1)
            if allowed:
                level = _clamp_to_allowed(level, allowed)
        cls = self._classes[level]
        if inputs.latency_budget_ms is not None:
            budget_s = inputs.latency_budget_ms / 1000.0
        else:
            budget_s = cls.ttft_budget_ms / 1000.0
        return Classification(
            tenant=tenant_name,
            service_class=cls.name,
            requested_class=self._classes[requested].name,
            level=level,
            budget_s=budget_s,
        )

    def _requested_level(self, inputs: QosInputs, tenant: Tenant | None) -> int:
        if inputs.qos_class is not None:
            level = self._level_of.get(inputs.qos_class)
            if level is None:
                raise QosInputError(
                    "unknown_class",
                    f"Unknown QoS class {inputs.qos_class!r}; "
                    f"expected one of {[c.name for c in self._classes]}.",
                    "qos_class",
                )
            return level
        if inputs.priority is not None:
            return min(max(inputs.priority, 0), len(self._classes) - 1)
        if inputs.task_type is not None:
            name = self.cfg.task_types.get(inputs.task_type)
            if name is None:
                raise QosInputError(
                    "unknown_task_type",
                    f"Unknown task_type {inputs.task_type!r}; "
                    f"expected one of {sorted(self.cfg.task_types)}.",
                    "task_type",
                )
            return self._level_of[name]
        if inputs.latency_budget_ms is not None:
            # the most relaxed class whose own budget still meets the asked one
            fitting = [
                c.level for c in self._classes if c.ttft_budget_ms <= inputs.latency_budget_ms
            ]
            return max(fitting) if fitting else 0
        default = (tenant.default_class if tenant else None) or self.cfg.default_class
        return self._level_of[default]


def _clamp_to_allowed(level: int, allowed: list[int]) -> int:
    """The most urgent allowed level that is not above ``level``; if every allowed level is above
    it (more urgent), the least urgent of them."""
    for a in allowed:
        if a >= level:
            return a
    return allowed[-1]
