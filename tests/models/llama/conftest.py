"""The real model's tests: a gateway with the llama.cpp engine per test (``gateway_factory``).

The model and its gateways are in ``tests/support/llama.py`` (importing it skips the folder where
llama.cpp or the model is missing). Everything is kept small (max_tokens <= 64, a few requests):
the folder runs on 2 busy cores. Still, a real model takes seconds where the simulated one takes
milliseconds: every test here is marked ``slow`` (``make test`` runs them, ``make test-fast`` not).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from qosgate.config import QosConfig
from tests.support.llama import InProcGateway

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.slow)


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


