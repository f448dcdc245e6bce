"""Command-line flags as config keys.

A command's flags override its config file. Each command has one table (``Flag`` rows) saying
which config key each flag sets (``flag_keys``), and ``set_keys`` sets them in the file's
mapping, which is then validated once, as the file alone would be (``settings.load_gateway``,
``sim.flags.with_keys``). So a flag and its key cannot drift apart, a bad value is reported by
the key's own validation, and the merge is written once for ``serve`` (the gateway's settings,
``SERVE_FLAGS``), ``simulate`` and ``replay`` (a scenario, ``sim/flags.py``).

A key is a dotted path (``server.port``); ``name[]`` in it means every entry of the list
``name`` (``upstreams[].max_window``: each upstream's).
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["SERVE_FLAGS", "UNSET", "Flag", "flag_keys", "set_keys", "split_list"]


class _Unset(enum.Enum):
    UNSET = "unset"


UNSET = _Unset.UNSET
"""What a ``Flag``'s ``convert`` returns for a value that sets nothing (an empty list)."""


@dataclass(frozen=True)
class Flag:
    """The command parameter ``param`` sets the config key ``key`` when given (not None).

    ``convert``: the flag's value as the key takes it (``UNSET`` from it: the key is not set).
    ``also``: other keys set, to these values, whenever the flag is given. ``renamed_to``: this
    flag is the deprecated name of the flag whose parameter is given here; it still sets the
    key, with a warning, unless that flag is given too (the new name wins)."""

    param: str
    key: str
    convert: Callable[[Any], Any] | None = None
    also: Mapping[str, Any] = field(default_factory=dict)
    renamed_to: str | None = None


Warn = Callable[[str, str], None]
"""Told (old parameter, new parameter) when a deprecated flag is given."""


def flag_keys(table: Iterable[Flag], values: Mapping[str, Any], warn: Warn | None = None
              ) -> dict[str, Any]:
    """The config keys the given flags set, in the table's order (a list before its entries'
    keys). ``values``: the command's parameters by name; None is a flag not given. ``warn``:
    told of each deprecated flag given."""
    out: dict[str, Any] = {}
    for f in table:
        value = values.get(f.param)
        if value is None:
            continue
        if f.renamed_to is not None:
            if warn is not None:
                warn(f.param, f.renamed_to)
            if values.get(f.renamed_to) is not None:
                continue
        if f.convert is not None:
            value = f.convert(value)
            if value is UNSET:
                continue
        out[f.key] = value
        out.update(f.also)
    return out


def set_keys(data: Mapping[str, Any], keys: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of ``data`` with each dotted key set (missing mappings on the way are created;
    ``name[]`` sets the key in every entry of the list ``name``, none if there is none)."""
    out = copy.deepcopy(dict(data))
    for key, value in keys.items():
        _set(out, key.split("."), value)
    return out


def _set(node: dict[str, Any], path: list[str], value: Any) -> None:
    head, rest = path[0], path[1:]
    if head.endswith("[]"):
        entries = node.get(head[:-2]) or []
        node[head[:-2]] = entries = [dict(e) for e in entries]
        for entry in entries:
            _set(entry, rest, value)
        return
    if not rest:
        node[head] = copy.deepcopy(value)
        return
    child = node.get(head)
    node[head] = child = dict(child) if isinstance(child, Mapping) else {}
    _set(child, rest, value)


def split_list(values: str | Iterable[str]) -> list[str]:
    """A repeatable, comma-separated flag's items."""
    items = [values] if isinstance(values, str) else list(values)
    return [x for v in items for x in v.split(",") if x]


SERVE_FLAGS: tuple[Flag, ...] = (
    Flag("host", "server.host"),
    Flag("port", "server.port"),
    Flag("shutdown_timeout", "server.shutdown_timeout_s"),
    Flag("log_level", "server.log_level"),
    Flag("metrics_port", "server.metrics_port"),
    Flag("metrics_auth", "server.metrics_auth"),
    Flag("max_connections", "server.max_connections"),
    Flag("request_log", "request_log.path"),
    Flag("request_log_sample", "request_log.sample"),
    Flag("admin_key", "server.admin_keys", lambda keys: split_list(keys) or UNSET),
    Flag("reuse_port", "server.reuse_port"),  # QOSGATE_REUSE_PORT=1, set by serve --workers
    Flag("redis", "redis.url"),
    Flag("instance_id", "redis.instance_id"),
    Flag("redis_fail_open", "redis.fail_open"),
    Flag("profile", "engine.profile"),
    Flag("time_scale", "engine.time_scale"),
    Flag("served_model_name", "engine.served_model_name"),
    Flag("engine", "engine.kind"),
    Flag("model", "engine.model", str),
    Flag("window", "engine.max_window"),
    Flag("sim_capacity", "engine.max_window", renamed_to="window"),
    Flag("max_num_seqs", "engine.max_num_seqs"),
    Flag("n_ctx", "engine.n_ctx"),
    Flag("threads", "engine.n_threads"),
    Flag("pause", "engine.pausable"),
    Flag("no_preflight", "engine.preflight", lambda on: False if on else UNSET),
    # the list first: the flags below set their key in each of its entries
    Flag("upstream", "upstreams",
         lambda urls: [{"url": u.strip()} for u in urls.split(",") if u.strip()] or UNSET),
    Flag("max_window", "upstreams[].max_window"),
    Flag("upstream_capacity", "upstreams[].max_window", renamed_to="max_window"),
    Flag("upstream_polarity", "upstreams[].priority_polarity"),
    Flag("upstream_api_key", "upstreams[].api_key"),
)
"""``qosgate serve``'s flags and the gateway settings' keys they set (``settings.py``)."""
