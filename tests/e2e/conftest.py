"""Tests that start real processes (gateways, the stand-in, Redis, Prometheus, vLLM, llama.cpp's
server, Python children), and the servers several of them share: one stand-in for the whole
session (``standin``).

Everything collected under this folder carries the ``e2e`` marker, so the folder and the marker
agree: ``-m "not e2e"`` leaves out exactly this folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import Server, start_standin

HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def tmp_session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gw")


@pytest.fixture(scope="session")
def standin(tmp_session: Path) -> Iterator[Server]:
    """The vLLM stand-in with priority scheduling, modelled time at real speed."""
    s = start_standin(tmp_session, "--scheduling-policy", "priority")
    yield s
    s.stop()
