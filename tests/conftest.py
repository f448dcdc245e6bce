"""Settings every test shares.

Hypothesis draws the same examples on every run (``derandomize``; no example database): a
property test that fails once fails every time, on every machine, so CI is never red by chance.
To search beyond that fixed set, ``HYPOTHESIS_PROFILE=explore pytest tests/core`` draws fresh
random examples (and more of them); anything it finds becomes a fixed test case.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("deterministic", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False, database=None, print_blob=True,
                          max_examples=1000)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "deterministic"))
