"""Prometheus exposition text, read back into samples a test can compare."""

from __future__ import annotations


def metric_values(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Samples of one metric: {sorted label pairs: value}."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        labels: list[tuple[str, str]] = []
        if "{" in head:
            body = head[head.index("{") + 1 : head.rindex("}")]
            for part in body.split('",'):
                if not part:
                    continue
                k, _, v = part.partition("=")
                labels.append((k, v.strip('"')))
        out[tuple(sorted(labels))] = float(value)
    return out
