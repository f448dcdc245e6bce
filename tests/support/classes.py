"""The default classes with one setting changed, for tests of a rule the default would hide."""

from __future__ import annotations

from qosgate.config import ServiceClass, default_config


def with_reserve(share: float) -> tuple[ServiceClass, ...]:
    """The default classes with realtime's reserved share set to ``share`` (0: none, for tests
    of another rule on a small window, where the default keeps one slot for realtime)."""
    return tuple(c.model_copy(update={"reserved_share": share}) if c.name == "realtime" else c
                 for c in default_config().classes)


def admitted_on_queue_time(classes: tuple[ServiceClass, ...] | None = None
                           ) -> tuple[ServiceClass, ...]:
    """``classes`` (the defaults) with deadline admission off: admitted against their queue
    timeout only, for tests of another rule on an engine slower than the classes' TTFT budgets
    (deadline admission would refuse what the test means to queue)."""
    return tuple(c.model_copy(update={"deadline_admission": False})
                 for c in (classes if classes is not None else default_config().classes))
