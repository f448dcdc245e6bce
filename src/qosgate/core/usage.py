"""What each tenant used of each model: requests, tokens, and the cost it was charged.

A tenant's bill and its fair share are in reference-model tokens (``core.weights``), which a
client cannot count by itself: it sees tokens. So both are kept side by side, per (tenant,
model), from the same settlement the fair-share counters get, and shown in the status, the
metrics and ``qosgate top``: a tenant whose 1,000 tokens cost 8,000 can see why.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class UsageRow:
    tenant: str
    model: str  # "" when the request named none
    requests: int
    prompt_tokens: int  # the whole prompt, as the tenant sent it (a cached part included)
    output_tokens: int
    charged: float  # in reference-model tokens: what fair share counted (cached prompt credited)


class Usage:
    """Per (tenant, model): ``[requests, prompt tokens, output tokens, charged]``, counted once
    per request when it ends."""

    __slots__ = ("_rows",)

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], list[float]] = {}

    def add(self, tenant: str, model: str, prompt_tokens: int, output_tokens: int,
            charged: float) -> None:
        """A request ended having used these (a request that never started used no prompt)."""
        row = self._rows.get((tenant, model))
        if row is None:
            row = self._rows[(tenant, model)] = [0, 0, 0, 0.0]
        row[0] += 1
        row[1] += prompt_tokens
        row[2] += output_tokens
        row[3] += charged

    def rows(self) -> tuple[UsageRow, ...]:
        return tuple(UsageRow(t, m, int(r[0]), int(r[1]), int(r[2]), r[3])
                     for (t, m), r in sorted(self._rows.items()))
