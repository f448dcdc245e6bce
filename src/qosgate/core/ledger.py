"""TenantLedger: where the scheduler gets each tenant's limiter (check / admit / release).

The default, ``LocalLedger``, is today's in-memory ``TenantLimiter`` per tenant (and per tenant
and model that the tenant has a limit of its own on, ``core.model_limits``). ``LeasedLedger``
is the half of the shared state that lives in the core: admission stays synchronous against local
*leased budgets* (request and token stock, concurrency slots) that the runtime
(``qosgate.runtime.shared_state``) tops up from, and gives back to, a store shared by every
gateway instance, on an interval. The core never waits for the store.

Reservations are keyed per request id: admitting an id that already holds a reservation charges
nothing more, and releasing an id settles its reservation once (a retry is never charged twice).

Modes of a leased limiter:
- ``leased``: spend only what was leased from the fleet (the store), so a limit holds fleet-wide;
- ``local``: the store is unreachable and the gateway fails open: local token buckets at this
  instance's share of each limit (limit / live instances), the concurrency cap likewise;
- ``closed``: the store is unreachable and the gateway fails closed: a limited tenant is refused.

What a tenant is told of its allowance (``allowance``) is this instance's local view in every mode:
its shadow, this instance's share of each limit and what this instance's admissions left of it.
The leases decide admission but are no bucket a client could plan by (what other instances spent
is known here only at the next sync), so the told allowance is a guide, not a promise.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator
from typing import Protocol

from qosgate.config import RateLimits
from qosgate.core.queueing.fairshare import FairShare
from qosgate.core.ratelimit import Allowance, TenantLimiter


class Limiter(Protocol):
    def check(self, tokens: int, now: float) -> tuple[str, float] | None: ...

    def admit(self, tokens: int, rid: str = "") -> None: ...

    def release(self, charged_tokens: int, used_tokens: int, rid: str = "") -> None: ...

    def allowance(self, now: float) -> Allowance: ...

    def retune(self, limits: RateLimits, now: float) -> None: ...


class TenantLedger(Protocol):
    def limiter(self, tenant: str, limits: RateLimits, now: float, model: str = "") -> Limiter:
        """``tenant``'s limiter over all its models, or (``model``) its limiter on that one."""
        ...


class LocalLedger:
    """One in-memory ``TenantLimiter`` per tenant: one instance's own limits (the default)."""

    def limiter(self, tenant: str, limits: RateLimits, now: float, model: str = "") -> Limiter:
        return TenantLimiter(limits, now)


def share_of(limits: RateLimits, live: int) -> RateLimits:
    """An instance's share of a tenant's limits when the fleet cannot be asked: limit / live
    instances (a concurrency cap rounds down, but leaves at least one slot)."""
    n = max(1, live)
    return RateLimits(
        requests_per_minute=limits.requests_per_minute / n if limits.requests_per_minute else None,
        tokens_per_minute=limits.tokens_per_minute / n if limits.tokens_per_minute else None,
        max_concurrent=max(1, limits.max_concurrent // n) if limits.max_concurrent else None,
    )


class LeasedLimiter:
    """A tenant's limits as budgets leased from the fleet (see the module's docstring); with
    ``model``, its limits on that model alone.

    Beside the leases it keeps a *shadow*: local buckets at this instance's share of each limit
    (limit / live instances), charged by every admission here whatever the mode. When the store
    becomes unreachable the shadow takes over, so it starts from what this instance admitted in
    the last minute (an instance that took more than its share is in debt), and a store that
    comes and goes cannot hand out a fresh share at every outage.
    """

    __slots__ = (
        "admitted", "concurrent", "limits", "live", "mode", "model", "peak", "refused_conc",
        "refused_req", "refused_tok", "req_stock", "reserved", "retry_hint", "shadow", "slots",
        "tenant", "tok_stock", "used_tok",
    )

    def __init__(self, tenant: str, limits: RateLimits, now: float, model: str = "") -> None:
        self.tenant = tenant
        self.model = model  # "": the tenant's limits over all models
        self.limits = limits
        self.mode = "leased"
        self.live = 1
        self.shadow = TenantLimiter(limits, now)
        self.concurrent = 0
        self.req_stock = 0.0  # requests leased and not yet spent
        self.tok_stock = 0.0  # tokens leased and not yet spent (negative: a debt to the fleet)
        self.slots = 0  # concurrency slots leased
        self.reserved: dict[str, int] = {}
        # since the last sync (the runtime reads and resets them): the demand it leases for
        self.admitted = 0
        self.peak = 0  # the most requests held at once
        self.used_tok = 0
        self.refused_req = 0
        self.refused_tok = 0
        self.refused_conc = 0
        self.retry_hint = 0.05  # seconds until a refused request may find stock (runtime sets)

    @property
    def limited(self) -> bool:
        lim = self.limits
        return bool(lim.requests_per_minute or lim.tokens_per_minute or lim.max_concurrent)

    def set_share(self, live: int) -> None:
        """The shadow buckets at limit / ``live`` (what they hold is kept, up to the new size)."""
        live = max(1, live)
        if live == self.live:
            return
        self.live = live
        share = share_of(self.limits, live)
        sh = self.shadow
        for bucket, per_minute in ((sh.rpm, share.requests_per_minute),
                                   (sh.tpm, share.tokens_per_minute)):
            if bucket is not None and per_minute:
                bucket.resize(per_minute)
        sh.max_concurrent = share.max_concurrent

    def retune(self, limits: RateLimits, now: float) -> None:
        """New limits (a reload): the fleet's budgets are leased at them from the next sync,
        and the shadow is resized to this instance's share of them."""
        self.limits = limits
        self.shadow.retune(share_of(limits, self.live), now)

    def check(self, tokens: int, now: float) -> tuple[str, float] | None:
        local = self.shadow.check(tokens, now)  # (also brings the shadow buckets up to now)
        if self.mode == "local":
            return local
        if self.mode == "closed":
            return ("shared_state_unavailable", self.retry_hint) if self.limited else None
        lim = self.limits
        if lim.max_concurrent is not None and self.concurrent >= self.slots:
            self.refused_conc += 1
            return "concurrency_limit", 0.0
        if lim.requests_per_minute and self.req_stock < 1:
            self.refused_req += 1
            return "rate_limit_requests", self.retry_hint
        if lim.tokens_per_minute and self.tok_stock < min(tokens, lim.tokens_per_minute):
            self.refused_tok += max(1, tokens)
            return "rate_limit_tokens", self.retry_hint
        return None

    def admit(self, tokens: int, rid: str = "") -> None:
        if rid:
            if rid in self.reserved:
                return  # already reserved under this id: never charged twice
            self.reserved[rid] = tokens
        self.concurrent += 1
        self.admitted += 1
        if self.concurrent > self.peak:
            self.peak = self.concurrent
        self.shadow.admit(tokens)
        if self.mode == "local":
            return
        if self.limits.requests_per_minute:
            self.req_stock -= 1
        if self.limits.tokens_per_minute:
            self.tok_stock -= tokens
            self.used_tok += tokens

    def release(self, charged_tokens: int, used_tokens: int, rid: str = "") -> None:
        if rid and self.reserved.pop(rid, None) is None:
            return  # settled already (or never reserved here)
        self.concurrent -= 1
        self.shadow.release(charged_tokens, used_tokens)
        if self.mode == "local":
            return
        if self.limits.tokens_per_minute and used_tokens != charged_tokens:
            # settle: an over-estimate returns to the stock, an under-estimate is a debt
            self.tok_stock += charged_tokens - used_tokens
            self.used_tok += used_tokens - charged_tokens

    def allowance(self, now: float) -> Allowance:
        """The local view (see the module's docstring): the shadow's share and what is left."""
        return self.shadow.allowance(now)

    # ------------------------------------------------------------ modes (the runtime calls)
    def go_local(self, live: int) -> None:
        """Fail open: the shadow buckets at this instance's share decide."""
        self.set_share(live)
        self.mode = "local"

    def go_closed(self) -> None:
        self.mode = "closed"

    def go_leased(self) -> None:
        """The store is back: spend only leased budgets again (from empty: the next sync leases
        afresh; requests running keep their place in ``concurrent``)."""
        self.mode = "leased"
        self.req_stock = 0.0
        self.tok_stock = min(self.tok_stock, 0.0)


class LeasedLedger:
    """The ledger of one instance of a fleet: a ``LeasedLimiter`` per tenant (``limiters``), and
    per tenant and model it has a limit of its own on (``model_limiters``)."""

    def __init__(self) -> None:
        self.limiters: dict[str, LeasedLimiter] = {}
        self.model_limiters: dict[tuple[str, str], LeasedLimiter] = {}
        self.mode = "leased"
        self.live = 1
        self.fail_open = True

    def limiter(self, tenant: str, limits: RateLimits, now: float, model: str = "") -> Limiter:
        lim = self.model_limiters.get((tenant, model)) if model else self.limiters.get(tenant)
        if lim is None:
            lim = LeasedLimiter(tenant, limits, now, model)
            if model:
                self.model_limiters[(tenant, model)] = lim
            else:
                self.limiters[tenant] = lim
            lim.set_share(self.live)
            if self.mode == "degraded":
                if self.fail_open:
                    lim.go_local(self.live)
                else:
                    lim.go_closed()
        return lim

    def every(self) -> list[LeasedLimiter]:
        """Every limiter: the tenants' over all models, then their limiters on one model."""
        return [*self.limiters.values(), *self.model_limiters.values()]

    def set_live(self, live: int) -> None:
        """The live instances seen at a sync: the shadow shares follow."""
        self.live = max(1, live)
        for lim in self.every():
            lim.set_share(self.live)

    def degrade(self, live: int, fail_open: bool) -> None:
        self.mode = "degraded"
        self.live = max(1, live)
        self.fail_open = fail_open
        for lim in self.every():
            if fail_open:
                lim.go_local(self.live)
            else:
                lim.go_closed()

    def recover(self) -> None:
        self.mode = "leased"
        for lim in self.every():
            lim.go_leased()


# ---------------------------------------------------------------- fair-share counters
def fair_shares(root: object, path: str = "") -> Iterator[tuple[str, FairShare[Hashable]]]:
    """Every fair-share counter set in a policy's queue tree, each with a stable path
    (``b<band>/c<class>`` ...), so the runtime can merge the counters of several instances."""
    from qosgate.core.queueing.nodes import FairSplit, StrictBands

    if isinstance(root, FairSplit):
        yield path or "root", root.share
        for key, child in list(root._children.items()):
            yield from fair_shares(child, f"{path}/k{key}")
    elif isinstance(root, StrictBands):
        for i, band in enumerate(root._bands):
            yield from fair_shares(band, f"{path}/b{i}")


def merge_counter(share: FairShare[Hashable], key: Hashable, delta: float) -> None:
    """Add other instances' service (already weighted) to ``key``'s counter."""
    if not delta or not math.isfinite(delta):
        return
    share.merge(key, delta)
