"""The gateway's ASGI app built for another ASGI server (``bench/asgi_servers.py`` runs it under
granian): one upstream at ``$QOSGATE_BENCH_UPSTREAM``, a fixed window, as the overhead bench."""

import os

from qosgate.config import Fleet, Window, default_config
from qosgate.server.compose import build_gateway
from qosgate.settings import GatewaySettings, UpstreamSettings

app = build_gateway(
    default_config(fleet=Fleet(window=Window(mode="fixed"))),
    GatewaySettings(upstreams=[UpstreamSettings(
        url=os.environ["QOSGATE_BENCH_UPSTREAM"], capacity=1024, priority_polarity="vllm")]),
)
