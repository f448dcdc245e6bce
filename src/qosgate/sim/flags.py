"""``simulate``'s and ``replay``'s flags as scenario keys (``flags.Flag``): the scenario file is
their config, and a flag overrides one of its keys, as ``serve``'s flags override the gateway's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qosgate.core.routing import ROUTERS
from qosgate.flags import UNSET, Flag, set_keys
from qosgate.sim.batches import parse_batch
from qosgate.sim.scenario_file import Scenario, ScenarioError, override
from qosgate.sim.setup import SIM_POLICIES


def _policies(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    if not names:
        raise ScenarioError(
            f"--policies names no policy: give one or more of {', '.join(SIM_POLICIES)}")
    return names


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ScenarioError(f"--gateways {text!r}: give counts like 4 or 1,2,4") from None
    if not counts:
        raise ScenarioError("--gateways names no count")
    return counts


def _routers(text: str) -> list[str]:
    names = [r.strip() for r in text.split(",") if r.strip()]
    if not names:
        raise ScenarioError(f"--router names no router: give one or more of {', '.join(ROUTERS)}")
    return names


def _one_router(text: str) -> Any:
    names = _routers(text)
    return names[0] if len(names) == 1 else UNSET


def _several_routers(text: str) -> Any:
    names = _routers(text)
    return names if len(names) > 1 else UNSET


def _off_is_none(text: str) -> Any:
    return None if text == "off" else text


def _jobs(texts: list[str]) -> Any:
    return [parse_batch(t).model_dump(by_alias=True, exclude_none=True) for t in texts] or UNSET


SCENARIO_FLAGS: tuple[Flag, ...] = (
    Flag("seed", "seed"),
    Flag("profile", "profile"),
    Flag("replicas", "replicas"),
    Flag("window", "window"),
    Flag("window_mode", "window_mode"),
    Flag("duration", "duration_s"),
    Flag("time_scale", "arrivals.time_scale"),
    # a load replaces the scenario's rate and its sweep
    Flag("load", "arrivals.load", also={"arrivals.rate": None, "sweep": None}),
)
"""The flags ``simulate`` and ``replay`` share."""

SIMULATE_FLAGS: tuple[Flag, ...] = (
    *SCENARIO_FLAGS,
    Flag("retries", "retries"),
    Flag("policies", "policies", _policies),
    Flag("gateways", "gateways.counts", _counts),
    Flag("spread", "gateways.spread"),
    Flag("shared_state", "gateways.shared"),
    Flag("sync_interval_s", "gateways.sync_interval_s"),
    Flag("sync_delay_s", "gateways.sync_delay_s"),
    # one router is every gateway's (and replaces the scenario's list); several, one run each
    Flag("router", "config.fleet.router", _one_router, also={"routers": []}),
    Flag("router", "routers", _several_routers),
    Flag("tpot_guard", "config.fleet.tpot_guard", _off_is_none),
    Flag("prefill_budget", "config.fleet.prefill_budget_tokens", _off_is_none),
    Flag("job", "jobs", _jobs),
)

REPLAY_FLAGS: tuple[Flag, ...] = (
    *SCENARIO_FLAGS,
    Flag("retries", "retries", lambda n: n or UNSET),  # 0, the default: the scenario's
    Flag("embedded", "pausable"),
    Flag("engine_queue", "engine_queue"),
)


def with_keys(scenario: Scenario, keys: Mapping[str, Any]) -> Scenario:
    """``scenario`` with the config keys set (``flags.flag_keys``), validated once by
    ``override``; a key of ``arrivals`` is passed alone, as ``override`` merges the arrivals
    and notes in the description what they change."""
    if not keys:
        return scenario
    data = set_keys(scenario.model_dump(by_alias=True), keys)
    changes: dict[str, Any] = {}
    for key, value in keys.items():
        top, _, rest = key.partition(".")
        if top == "arrivals" and rest:
            changes.setdefault("arrivals", {})[rest] = value
        else:
            changes[top] = data[top]
    return override(scenario, **changes)

