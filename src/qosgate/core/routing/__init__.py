"""Which eligible replica a request goes to: the ``Router`` protocol and one module per router.

``most_free`` (the most free slots), ``least_load`` (measured load, the default),
``least_load_spread`` (least load, spreading the strict classes' streams), and the routers that
also weigh where a request is cheapest: ``session_affinity`` and ``cache_aware``, with their
parts ``sessions`` (a conversation's last replica), ``prefix_index`` (which blocks each replica
holds) and ``holds`` (requests left queued by choice). ``base`` has the protocol, whose hooks do
nothing unless a router keeps state; ``registry`` builds each router by its config name
(``fleet.router``). A router reads replicas and requests, never the fleet or the scheduler that
call it.
"""

from qosgate.core.routing.base import Router, RouterContext
from qosgate.core.routing.registry import ROUTERS, build_router

__all__ = ["ROUTERS", "Router", "RouterContext", "build_router"]
