"""Each router by its config name (``fleet.router``), built from a ``RouterContext``."""

from __future__ import annotations

from collections.abc import Callable

from qosgate.core.routing.base import Router, RouterContext
from qosgate.core.routing.cache_aware import CacheAwareRouter
from qosgate.core.routing.least_load import LeastLoadRouter
from qosgate.core.routing.least_load_spread import SpreadStrictRouter
from qosgate.core.routing.most_free import MostFreeRouter
from qosgate.core.routing.session_affinity import SessionAffinityRouter

# each router by name, built from a ``RouterContext`` (the strict classes' budgets and
# ``fleet.cache``), which only some of them read
ROUTERS: dict[str, Callable[[RouterContext], Router]] = {
    "most-free": lambda _: MostFreeRouter(),
    "least-load": lambda _: LeastLoadRouter(),
    SpreadStrictRouter.name: lambda ctx: SpreadStrictRouter(ctx.strict_tpot_s),
    "session-affinity": SessionAffinityRouter,
    "cache-aware": CacheAwareRouter,
}


def build_router(name: str, ctx: RouterContext | None = None) -> Router:
    """The router called ``name``."""
    try:
        make = ROUTERS[name]
    except KeyError:
        raise ValueError(f"unknown router {name!r} (known: {', '.join(ROUTERS)})") from None
    return make(ctx if ctx is not None else RouterContext())
