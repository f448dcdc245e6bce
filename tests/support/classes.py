"""The default classes with one setting changed, for tests of a rule the default would hide."""

from __future__ import annotations

from qosgate.config import ServiceClass, default_config


def with_reserve(share: float) -> tuple[ServiceClass, ...]:
    """The default classes with realtime's reserved share set to ``share`` (0: none, for tests
    of another rule on a small window, where the default keeps one slot for realtime)."""
    return tuple(c.model_copy(update={"reserved_share": share}) if c.name == "realtime" else c
                 for c in default_config().classes)
