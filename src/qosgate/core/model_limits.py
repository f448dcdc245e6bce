"""A tenant's limits on one model (``tenants[].limits.models``), on top of its limits over all
models.

A request is checked against its tenant's limiter and, when the tenant has a limit on the
request's model, against that (tenant, model) limiter too: it is admitted only when both have
room, then charged, settled and released on both. Each (tenant, model) pair has a limiter of
its own, made by the same ledger as the tenant's (with shared state, its budgets are leased from
the fleet under keys of their own), so a limit on one model never refuses a request on another.

A LoRA adapter (``models[].base``) without an entry of its own counts against its base model's
entry, in the same limiter: as OpenAI applies a limit set on a model to that model's fine-tunes.
An adapter with an entry of its own is a model of its own.

A refusal by a limit on one model carries a reason of its own (``model_rate_limit_requests`` ...),
so that the answer can name the model and its limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from qosgate.config import RateLimits, Tenant
from qosgate.core.ledger import Limiter, TenantLedger
from qosgate.core.ratelimit import Allowance, Quota
from qosgate.core.reasons import Reason

# a tenant-wide refusal's reason -> the same refusal by a limit on one model (a reason not
# here, such as the shared state's being unavailable, reads the same for both)
_ON_MODEL: dict[str, str] = {
    Reason.RATE_LIMIT_REQUESTS: Reason.MODEL_RATE_LIMIT_REQUESTS,
    Reason.RATE_LIMIT_TOKENS: Reason.MODEL_RATE_LIMIT_TOKENS,
    Reason.CONCURRENCY_LIMIT: Reason.MODEL_CONCURRENCY_LIMIT,
}
MODEL_REASONS = frozenset(_ON_MODEL.values())
_NO_LIMITS = RateLimits()


def limited_model(limits: dict[str, RateLimits], model: str, base_of: Callable[[str], str]
                  ) -> str | None:
    """The model whose entry of ``limits`` applies to a request on ``model``: its own, else (an
    adapter's) its base model's; None when neither has one."""
    if model in limits:
        return model
    base = base_of(model)
    return base if base != model and base in limits else None


def tighter(tenant: Allowance, on_model: Allowance) -> Allowance:
    """What a tenant is told of its allowance on a model it has a limit on: per limit, the one
    that binds first (the fewer left; the smaller on a tie), since a client pacing itself by the
    looser would be refused by the other."""
    tenant_free = _free(tenant)
    model_free = _free(on_model)
    slots = on_model if model_free is not None and (tenant_free is None
                                                    or model_free < tenant_free) else tenant
    return Allowance(
        requests=_binding(tenant.requests, on_model.requests),
        tokens=_binding(tenant.tokens, on_model.tokens),
        concurrent=slots.concurrent,
        max_concurrent=slots.max_concurrent,
    )


def _free(allowance: Allowance) -> int | None:
    if allowance.max_concurrent is None:
        return None
    return allowance.max_concurrent - allowance.concurrent


def _binding(a: Quota | None, b: Quota | None) -> Quota | None:
    if a is None or b is None:
        return a or b
    return min(a, b, key=lambda q: (q.remaining, q.limit))


class OnModel:
    """A request's limiters when its tenant has a limit on its model: the tenant's (over all
    models) and the (tenant, model) one, as one ``Limiter`` (``retune`` is each one's own)."""

    __slots__ = ("held", "on_model", "tenant")

    def __init__(self, tenant: Limiter, on_model: Limiter, held: dict[str, Limiter]) -> None:
        self.tenant = tenant
        self.on_model = on_model
        self.held = held  # request id -> the (tenant, model) limiter that holds its reservation

    def check(self, tokens: int, now: float) -> tuple[str, float] | None:
        """The refusal of either, or, when both refuse, the one with the longer wait (a client
        told the shorter would be refused again by the other)."""
        overall = self.tenant.check(tokens, now)
        scoped = self.on_model.check(tokens, now)
        if scoped is not None:
            scoped = (_ON_MODEL.get(scoped[0], scoped[0]), scoped[1])
            if overall is None or scoped[1] > overall[1]:
                return scoped
        return overall

    def admit(self, tokens: int, rid: str = "") -> None:
        self.tenant.admit(tokens, rid)
        if rid in self.held:
            return  # already reserved under this id: never charged twice
        self.on_model.admit(tokens, rid)
        self.held[rid] = self.on_model

    def release(self, charged_tokens: int, used_tokens: int, rid: str = "") -> None:
        self.tenant.release(charged_tokens, used_tokens, rid)
        settle(self.held, charged_tokens, used_tokens, rid)

    def allowance(self, now: float) -> Allowance:
        return tighter(self.tenant.allowance(now), self.on_model.allowance(now))

    def retune(self, limits: RateLimits, now: float) -> None:
        """Nothing: its two limiters are retuned by their owners (the scheduler, the tenant's;
        ``ModelLimiters.retenant``, the one on the model)."""


class ModelLimiters:
    """Every tenant's limiters on one model, made by ``ledger`` as requests first need them.

    ``held`` is which (tenant, model) limiter each admitted request holds a reservation on, so
    that its release settles that one exactly once, whatever a reload changed meanwhile.
    """

    def __init__(self, ledger: TenantLedger, tenants: Iterable[Tenant],
                 base_of: Callable[[str], str], now: float) -> None:
        self.ledger = ledger
        self.base_of = base_of
        self.limiters: dict[tuple[str, str], Limiter] = {}
        self.held: dict[str, Limiter] = {}
        self._limits: dict[str, dict[str, RateLimits]] = {}
        # (tenant, requested model) -> its ``OnModel``, or None: no limit of the tenant on it
        self._gates: dict[tuple[str, str], OnModel | None] = {}
        self.retenant(tenants, now)

    def retenant(self, tenants: Iterable[Tenant], now: float) -> None:
        """The limits on one model of ``tenants`` (a reload): a limiter made already is retuned
        (to no limit at all when its entry is gone); requests admitted keep their reservations."""
        self._limits = {t.name: dict(t.limits.models) for t in tenants if t.limits.models}
        self._gates.clear()
        for (tenant, model), lim in self.limiters.items():
            lim.retune(self._limits.get(tenant, {}).get(model, _NO_LIMITS), now)

    def gate(self, tenant_limiter: Limiter, tenant: str, model: str, now: float) -> Limiter:
        """The limiter a request of ``tenant`` on ``model`` is checked, charged and released on:
        ``tenant_limiter`` alone, or with the tenant's limiter on the model (``OnModel``)."""
        key = (tenant, model)
        try:
            gate = self._gates[key]
        except KeyError:
            gate = self._gates[key] = self._gate(tenant_limiter, tenant, model, now)
        return tenant_limiter if gate is None else gate

    def _gate(self, tenant_limiter: Limiter, tenant: str, model: str, now: float
              ) -> OnModel | None:
        limits = self._limits.get(tenant)
        scope = limited_model(limits, model, self.base_of) if limits else None
        if scope is None or limits is None:
            return None
        return OnModel(tenant_limiter, self.limiter(tenant, scope, limits[scope], now), self.held)

    def limiter(self, tenant: str, model: str, limits: RateLimits, now: float) -> Limiter:
        lim = self.limiters.get((tenant, model))
        if lim is None:
            lim = self.limiters[(tenant, model)] = self.ledger.limiter(tenant, limits, now, model)
            # a ledger may hand back one it made before a reload (``shared.prime``'s): the
            # limits are those of now
            lim.retune(limits, now)
        return lim

    def release(self, charged_tokens: int, used_tokens: int, rid: str) -> None:
        """A request ended: settle its reservation on a limit on its model, if it holds one."""
        if self.held:
            settle(self.held, charged_tokens, used_tokens, rid)


def settle(held: dict[str, Limiter], charged_tokens: int, used_tokens: int, rid: str) -> None:
    """Release request ``rid`` on the limiter on one model that holds it, once (none: nothing)."""
    lim = held.pop(rid, None)
    if lim is not None:
        lim.release(charged_tokens, used_tokens, rid)
