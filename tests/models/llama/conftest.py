"""The real model's tests: a gateway with the llama.cpp engine per test (``gateway_factory``).

The model and its gateways are in ``tests/support/llama.py`` (importing it skips the folder where
llama.cpp or the model is missing). Everything is kept small (max_tokens <= 64, a few requests):
the folder runs on 2 busy cores.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from qosgate.config import QosConfig
from tests.support.llama import InProcGateway


@pytest.fixture
def gateway_factory() -> Iterator[Callable[..., InProcGateway]]:
    made: list[InProcGateway] = []

    def make(cfg: QosConfig | None = None, **engine: Any) -> InProcGateway:
        gw = InProcGateway(cfg, **engine)
        made.append(gw)
        return gw

    yield make
    for gw in made:
        gw.stop()


