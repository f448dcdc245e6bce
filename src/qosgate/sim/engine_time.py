"""Fair share in engine time: each tenant's accelerator time, and Jain's index over the tenants
of a class in it.

Fairness in tokens (``metrics.tenant_fairness``) says who was served how many tokens; with
several models a token of one costs many times the accelerator time of a token of another, so
tenants even in tokens may be far apart in what they took of the fleet. A tenant's *engine time*
is its requests' share of every engine step they took part in (``SimEngine.engine_time``: its own
per-token terms and a token-proportional share of its model's fixed step cost), prefill and
decode apart; the tenants' times add up to the replicas' busy time.

Jain's index is taken over each tenant's engine time per unit of its weight (the tenants' fair
share weights), over the arrival span after the warm-up: 1 when every tenant took the same time
per weight, 1/n when one took it all. It has no max-min correction for demand, as the token
fairness has: what a request that was never served would have cost the engine is not known
before it runs (it is read with every tenant backlogged, where the two agree).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from qosgate.sim.metrics import jain
from qosgate.sim.results import RunResult


def engine_fairness(result: RunResult, tenant_weight: Callable[[str], float]) -> dict[str, Any]:
    """Per class: each tenant's engine time over the arrival span after the warm-up (and over
    the whole run) and, with two tenants or more, Jain's index over their time per weight."""
    out: dict[str, Any] = {}
    for cls, tenants in result.engine_time_window.items():
        whole = result.engine_time.get(cls, {})
        rows: dict[str, dict[str, float]] = {}
        for tenant, t in tenants.items():
            run = whole.get(tenant, {"prefill_s": 0.0, "decode_s": 0.0})
            rows[tenant] = {
                "weight": tenant_weight(tenant),
                "prefill_s": t["prefill_s"],
                "decode_s": t["decode_s"],
                "engine_s": t["prefill_s"] + t["decode_s"],
                "run_engine_s": run["prefill_s"] + run["decode_s"],
            }
        total = math.fsum(r["engine_s"] for r in rows.values())
        for r in rows.values():
            r["share"] = r["engine_s"] / total if total > 0 else 0.0
        out[cls] = {
            "jain": jain([r["engine_s"] / r["weight"] for r in rows.values()])
            if len(rows) > 1 else None,
            "tenants": rows,
        }
    return out
