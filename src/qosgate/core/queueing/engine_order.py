"""qosgate's pick order as one integer an engine can sort its own waiting queue by.

An engine queues what it cannot run yet and orders that queue itself: vLLM by ``(priority,
arrival)``, smaller first. Sending only the class there let a request wait inside the engine
behind work of the same class that qosgate had released a moment earlier and would have picked
after it (a light tenant behind a flood). So the value carries the whole order: the engine band
first (the class, or the strict band it is served from), then the request's rank inside it as
its policy orders the band (the tenant's fair-share position, or arrival, or deadline; see
``policies``). Values are non-negative and smaller-first; ``wire.splice`` turns them round
for an engine that runs larger values first.

A rank is clamped into its band's stride, so it can never cross into another band; bands times
the stride stay below 2**53, so a JSON number read as a double by anything in between keeps its
order.
"""

from __future__ import annotations

RANK_BITS = 40
STRIDE = 1 << RANK_BITS  # ranks per band: 1.1e12 (tokens of fair-share service, or ms)
# rank 0 sits this far into the band: a tenant back from idle may be ordered a little before
# the counters' origin (``fairshare``: just before the oldest unstarted tag)
ORIGIN = 1 << 20
_TOP = STRIDE - 1  # the largest rank in a band


def order_value(band: int, rank: float) -> int:
    """The engine-side order of a request in ``band`` with ``rank`` (both smaller-first; ranks
    one apart stay apart)."""
    r = rank + ORIGIN
    if 0.0 < r < _TOP:  # the common case first (False for NaN)
        return band * STRIDE + int(r)
    if r != r or r <= 0.0:  # NaN, or far before the origin
        return band * STRIDE
    return band * STRIDE + _TOP  # far past it, or infinite


def band_of(value: int) -> int:
    """The band an order value was made from."""
    return value >> RANK_BITS


def top(levels: int) -> int:
    """One past the largest order value with ``levels`` bands: for larger-first engines."""
    return levels * STRIDE
