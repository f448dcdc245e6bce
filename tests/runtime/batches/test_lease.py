"""The lease of one gateway alone (``LocalLease``): its fence starts above the stored one.
(Leases in a real Redis, and gateways sharing one: ``tests/e2e/batches/test_feed_lease.py``.)"""

from __future__ import annotations

import asyncio

from qosgate.runtime.batches.lease import LocalLease


def test_local_lease_takes_a_fence_above_the_stored_one() -> None:
    async def run() -> None:
        lease = LocalLease()
        assert await lease.acquire("batch_1", 6) == 7
        assert await lease.renew("batch_1")

    asyncio.run(run())
