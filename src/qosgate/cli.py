"""The ``qosgate`` command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from qosgate import __version__
from qosgate.config import ConfigError, QosConfig, default_config, load_config

app = typer.Typer(
    help="qosgate: a QoS scheduler for LLM inference.",
    no_args_is_help=True,
    add_completion=False,
)
console = Console()

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML config (tenants, classes, limits).")
]


def _load(path: Path | None) -> QosConfig:
    if path is None:
        return default_config()
    try:
        return load_config(path)
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version.")] = False,
) -> None:
    if version:
        console.print(f"qosgate {__version__}")
        raise typer.Exit()


@app.command()
def serve(config: ConfigOpt = None) -> None:
    """Serve the OpenAI-compatible gateway (not built yet: it lands with the gateway issue)."""
    _load(config)
    console.print("qosgate serve: the gateway is not built yet (next issue).")
    raise typer.Exit(1)


@app.command("config")
def show_config(config: ConfigOpt = None) -> None:
    """Validate a config and print the effective classes, tiers and tenants."""
    cfg = _load(config)
    classes = Table(title=f"service classes (policy: {cfg.policy})")
    for col in (
        "class",
        "level",
        "strict",
        "weight",
        "TTFT budget",
        "queue timeout",
        "max queue",
        "aging after",
        "preemptible",
        "can preempt",
    ):
        classes.add_column(col)
    for c in cfg.classes:
        classes.add_row(
            c.name,
            f"P{c.level}",
            "yes" if c.strict else "",
            f"{c.weight:g}",
            f"{c.ttft_budget_ms:g} ms",
            f"{c.queue_timeout_s:g} s",
            str(c.max_queue),
            f"{c.aging_after_s:g} s" if c.aging_after_s else "-",
            "yes" if c.preemptible else "",
            "yes" if c.can_preempt else "",
        )
    console.print(classes)
    tiers = Table(title="tiers")
    tiers.add_column("tier")
    tiers.add_column("boost (levels)")
    for tier in cfg.tiers:
        tiers.add_row(tier.name, f"{tier.boost:+d}")
    console.print(tiers)
    if not cfg.tenants:
        console.print("no tenants: the gateway runs open, as one default tenant")
    else:
        tenants = Table(title="tenants")
        for col in (
            "tenant",
            "tier",
            "weight",
            "keys",
            "allowed classes",
            "rpm",
            "tpm",
            "max conc",
        ):
            tenants.add_column(col)
        for t in cfg.tenants:
            lim = t.limits
            tenants.add_row(
                t.name,
                t.tier,
                f"{t.weight:g}",
                str(len(t.api_keys)),
                ",".join(t.allowed_classes) if t.allowed_classes else "all",
                f"{lim.requests_per_minute:g}" if lim.requests_per_minute else "-",
                f"{lim.tokens_per_minute:g}" if lim.tokens_per_minute else "-",
                str(lim.max_concurrent or "-"),
            )
        console.print(tenants)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
