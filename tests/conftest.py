"""Settings every test shares.

Hypothesis draws the same examples on every run (``derandomize``; no example database): a
property test that fails once fails every time, on every machine, so CI is never red by chance.
To search beyond that fixed set, ``HYPOTHESIS_PROFILE=explore pytest tests/core`` draws fresh
random examples (and more of them); anything it finds becomes a fixed test case.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)


def _no_local_constants() -> None:
    """Hypothesis also draws constants it reads from the source of every local module loaded
    so far, so a derandomized test drew other examples in a whole run than run alone (a clean
    clone's full run found a case that the test's file alone never drew). With none of those,
    its examples depend on the test alone. (An internal of Hypothesis: where it is missing,
    there is nothing to pin.)"""
    from hypothesis.internal.conjecture import providers

    if hasattr(providers, "_get_local_constants") and hasattr(providers, "Constants"):
        empty = providers.Constants()
        providers._get_local_constants = lambda: empty


settings.register_profile("explore", derandomize=False, database=None, print_blob=True,
                          max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
if settings.default.derandomize:
    _no_local_constants()


E2E = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that starts a process lives in ``tests/e2e`` (which marks it ``e2e``): one marked
    by hand elsewhere is moved there, so that the folder and the marker say the same."""
    stray = [item.nodeid for item in items
             if item.get_closest_marker("e2e") and not item.path.is_relative_to(E2E)]
    if stray:
        raise pytest.UsageError("marked e2e outside tests/e2e (move them there): "
                                + ", ".join(stray))


@pytest.fixture(autouse=True, scope="session")
def _batch_state_in_tmp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A gateway keeps batch jobs under ``$XDG_STATE_HOME/qosgate``: a test's gateway (in this
    process, or one it starts) keeps them in the session's tmp dir, never in the user's."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state")))
    yield
    mp.undo()
