"""In what order queued requests go: the queueing policies (``policies``: ``fifo``,
``priority``, ``wfq``, ``qos``, chosen by name), each a small tree of queue nodes (``nodes``:
a keyed heap, strict bands, a weighted fair split), the virtual counters the fair splits share
with the tenant ledger (``fairshare``), and the same order as one integer an engine sorts its
own waiting queue by (``engine_order``). A queue tree reads requests, never the fleet, the
routers or the scheduler that drive it.
"""

from qosgate.core.queueing.policies import POLICIES, POLICY_NAMES, Policy, build_policy

__all__ = ["POLICIES", "POLICY_NAMES", "Policy", "build_policy"]
