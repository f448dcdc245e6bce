"""What a reload of the config file changes (``Changes``, pure: two configs in, a verdict out),
and its refusal (``ReloadRefused``).

A reload (SIGHUP, or ``POST /v1/qos/reload`` with an admin key) reads the file again as start-up
read it, flags included, and validates it whole before anything changes. What it applies, in one
step on the event loop, is what operators change while a gateway serves: tenants (their keys,
tiers, weights, allowed classes and limits), the tier boosts, the admin keys, and upstreams
added or taken out (``server/upstreams.py``). A request already admitted keeps the rules it was
admitted with. The classes shape every part of the scheduler (queues, timers, windows), so a
file whose classes differ is refused whole and the running config is kept; every other section
that differs (an upstream changed under its name, the engine, the server's listeners, Redis,
...) is kept as it runs until a restart, and the reload says which.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qosgate.config import QosConfig
from qosgate.settings import GatewaySettings, UpstreamSettings, upstream_name

# the QoS sections a reload applies; every other one needs a restart
APPLIED = frozenset(("tenants", "tiers", "default_tenant"))


class ReloadRefused(Exception):
    """The new file is not applied (invalid, or it changes what needs a restart); the running
    config is kept. The message says why."""


@dataclass(frozen=True)
class Changes:
    tenants_added: tuple[str, ...] = ()
    tenants_removed: tuple[str, ...] = ()
    tenants_changed: tuple[str, ...] = ()  # keys, tier, weight, allowed classes or limits
    keys_added: int = 0
    keys_removed: int = 0
    tiers_changed: bool = False
    admin_keys_changed: bool = False
    upstreams_added: tuple[str, ...] = ()  # built and probed before they take work
    upstreams_retired: tuple[str, ...] = ()  # no new work; what runs there finishes
    needs_restart: tuple[str, ...] = ()  # sections that differ, kept as they run

    def summary(self) -> dict[str, Any]:
        return {
            "tenants": {"added": list(self.tenants_added), "removed": list(self.tenants_removed),
                        "changed": list(self.tenants_changed)},
            "api_keys": {"added": self.keys_added, "removed": self.keys_removed},
            "tiers_changed": self.tiers_changed,
            "admin_keys_changed": self.admin_keys_changed,
            "upstreams": {"added": list(self.upstreams_added),
                          "retired": list(self.upstreams_retired)},
            "kept_until_restart": list(self.needs_restart),
        }

    def describe(self) -> str:
        """One log line's worth."""
        parts = [f"tenants +{len(self.tenants_added)} -{len(self.tenants_removed)} "
                 f"~{len(self.tenants_changed)}", f"keys +{self.keys_added} -{self.keys_removed}"]
        if self.tiers_changed:
            parts.append("tiers changed")
        if self.admin_keys_changed:
            parts.append("admin keys changed")
        if self.upstreams_added or self.upstreams_retired:
            parts.append(f"upstreams +{len(self.upstreams_added)} "
                         f"-{len(self.upstreams_retired)}")
        if self.needs_restart:
            parts.append("kept until a restart: " + ", ".join(self.needs_restart))
        return "; ".join(parts)


def changes(old: tuple[QosConfig, GatewaySettings], new: tuple[QosConfig, GatewaySettings]
            ) -> Changes:
    """What applying ``new`` over ``old`` changes; ``ReloadRefused`` if its classes differ."""
    (ocfg, oset), (ncfg, nset) = old, new
    if ncfg.classes != ocfg.classes:
        raise ReloadRefused(
            "the classes differ from the running ones: they shape every queue and timer, so a "
            "restart applies them; nothing was changed")
    was = {t.name: t for t in ocfg.tenants}
    now = {t.name: t for t in ncfg.tenants}
    old_keys = {k for t in ocfg.tenants for k in t.api_keys}
    new_keys = {k for t in ncfg.tenants for k in t.api_keys}
    restart = [name for name in QosConfig.model_fields
               if name not in APPLIED and name != "classes"
               and getattr(ocfg, name) != getattr(ncfg, name)]
    added: list[str] = []
    retired: list[str] = []
    for name in GatewaySettings.model_fields:
        o, n = getattr(oset, name), getattr(nset, name)
        if name == "upstreams" and oset.upstreams and nset.upstreams:
            added, retired, kept = _upstreams(oset.upstreams, nset.upstreams)
            if kept:
                restart.append(f"upstreams ({', '.join(kept)})")
            continue
        if name == "server":
            o, n = o.model_copy(update={"admin_keys": ()}), n.model_copy(update={"admin_keys": ()})
        if o != n:
            restart.append(name)
    return Changes(
        tenants_added=tuple(sorted(now.keys() - was.keys())),
        tenants_removed=tuple(sorted(was.keys() - now.keys())),
        tenants_changed=tuple(sorted(n for n in now.keys() & was.keys() if now[n] != was[n])),
        keys_added=len(new_keys - old_keys),
        keys_removed=len(old_keys - new_keys),
        tiers_changed=ncfg.tiers != ocfg.tiers or ncfg.default_tenant != ocfg.default_tenant,
        admin_keys_changed=set(nset.server.admin_keys) != set(oset.server.admin_keys),
        upstreams_added=tuple(added),
        upstreams_retired=tuple(retired),
        needs_restart=tuple(restart),
    )


def _upstreams(old: tuple[UpstreamSettings, ...], new: tuple[UpstreamSettings, ...]
               ) -> tuple[list[str], list[str], list[str]]:
    """(added, retired, kept until a restart) by name. Kept: one whose settings changed under
    its name, or a new one that follows KV-cache events (its subscription is made at start-up).
    Upstreams in place of the built-in engine, or the other way round, need a restart: the
    caller compares the whole section then."""
    was = {upstream_name(u, i): u for i, u in enumerate(old)}
    now = {upstream_name(u, i): u for i, u in enumerate(new)}
    added = [n for n in now if n not in was and now[n].kv_events is None]
    kept = [n for n in now if n in was and now[n] != was[n]]
    kept += [n for n in now if n not in was and now[n].kv_events is not None]
    return added, [n for n in was if n not in now], kept


def applied(running: GatewaySettings, new: GatewaySettings, found: Changes) -> GatewaySettings:
    """The settings in force once ``found`` is applied: the new admin keys and upstreams (those
    kept until a restart as they run), everything else as it runs."""
    server = running.server.model_copy(update={"admin_keys": new.server.admin_keys})
    if not (found.upstreams_added or found.upstreams_retired):
        return running.model_copy(update={"server": server})
    was = {upstream_name(u, i): u for i, u in enumerate(running.upstreams)}
    ups = tuple(was.get(upstream_name(u, i), u) for i, u in enumerate(new.upstreams))
    return running.model_copy(update={"server": server, "upstreams": ups})
