"""How the simulator's terminal tables write numbers (shared by ``report_tables`` and
``batches_tables``, so a figure reads the same in every table)."""

from __future__ import annotations


def ms(x: float | None) -> str:
    """Compact: 356ms, 1.25s, 13.9s, 62s."""
    if x is None:
        return "-"
    if x < 1000:
        return f"{x:.0f}ms"
    if x < 10_000:
        return f"{x / 1000:.2f}s"
    if x < 100_000:
        return f"{x / 1000:.1f}s"
    return f"{x / 1000:.0f}s"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def seconds(x: float | None) -> str:
    """A figure kept in seconds (a Retry-After), written as ``ms`` writes one."""
    return ms(None if x is None else x * 1000.0)
