"""The folder's shared servers: one stand-in for the whole session (``standin``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.processes import Server, start_standin


@pytest.fixture(scope="session")
def tmp_session(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gw")


@pytest.fixture(scope="session")
def standin(tmp_session: Path) -> Iterator[Server]:
    """The vLLM stand-in with priority scheduling, modelled time at real speed."""
    s = start_standin(tmp_session, "--scheduling-policy", "priority")
    yield s
    s.stop()


