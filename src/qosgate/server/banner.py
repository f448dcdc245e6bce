"""What ``qosgate serve`` prints once it accepts connections: where it listens, each replica and
its window, and whether it runs open.

The windows are read from the scheduler as built, before anything is served: an adaptive window
(``core/windows.py``) starts small and moves with the engine's load between its floor and the
replica's capacity, so the banner gives both the start and the cap; a fixed one is the capacity.
"""

from __future__ import annotations

from typing import Any

from qosgate import __version__
from qosgate.config import QosConfig
from qosgate.core.windows import AdaptiveWindow
from qosgate.server.app import Gateway
from qosgate.settings import GatewaySettings


def window_text(rule: Any, max_window: int) -> str:
    """``rule`` as built (its starting value): adaptive, or the fixed window."""
    if isinstance(rule, AdaptiveWindow):
        return f"window adaptive: starts at {rule.window}, at most {rule.max_window}"
    return f"window {max_window}"


def windows(gw: Gateway) -> dict[str, str]:
    """Each replica's window as it starts; call before serving (an adaptive one then moves)."""
    return {name: window_text(gw.scheduler.replicas[name].window_rule, e.max_window)
            for name, e in gw.engines.items()}


def engine_description(e: Any, profile: str) -> str:
    inner: Any = getattr(e, "engine", None)
    path = getattr(inner, "model_path", None)
    if path is not None:
        how = "pauses at a token boundary" if e.pausable else "no pausing"
        return (f"llama.cpp in-process, model {path} ({', '.join(e.models())}), "
                f"{inner.max_num_seqs} KV slots, {how}")
    return f"built-in simulated engine ({profile}, a stand-in: no real model)"


def llama_line(checked: str | None) -> str:
    """What the loaded llama.cpp was built to use (the first thing to read when it crashes) and
    how the start-up check went (``runtime/preflight.py``)."""
    from qosgate.models.llamacpp import system_info

    return f"    llama.cpp: {system_info()}" + (f"; {checked}" if checked else "")


def banner(gw: Gateway, cfg: QosConfig, settings: GatewaySettings, api: str,
           metrics: str | None, starts: dict[str, str], checked: str | None = None) -> list[str]:
    """The lines (rich markup) for a gateway serving on ``api`` (and ``metrics``), with the
    replicas' windows as they started (``windows``) and, for the embedded engine, the start-up
    check's line (``checked``)."""
    lines = [f"qosgate {__version__} serving on {api}  (policy {gw.scheduler.policy.name})"]
    if metrics is not None:
        lines.append(f"  /metrics on {metrics}/metrics only"
                     + (" (admin key)" if settings.server.metrics_auth else ""))
    for name, e in gw.engines.items():
        where = getattr(e, "base", None) or engine_description(e, settings.engine.profile)
        lines.append(f"  replica {name}: {where}, {starts[name]}")
        if getattr(getattr(e, "engine", None), "model_path", None) is not None:
            lines.append(llama_line(checked))
    if gw.open:
        lines.append("  [yellow]no tenants configured: running OPEN as one default tenant "
                     f"({cfg.default_tenant!r}); any key is accepted[/yellow]")
    else:
        lines.append(f"  tenants: {', '.join(t.name for t in cfg.tenants)}")
    return lines
