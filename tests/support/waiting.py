"""Every wait in a test is on a condition, with a bound."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable


def wait_until(cond: Callable[[], object], timeout: float = 5.0, every: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if cond():
                return True
        time.sleep(every)
    return False
