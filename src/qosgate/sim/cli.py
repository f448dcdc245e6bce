"""``qosgate simulate``: compare policies on a scenario, in virtual time."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
)

from qosgate.config import Fleet
from qosgate.core.routing import ROUTERS
from qosgate.extras import PLOTS, missing
from qosgate.sim.batches import parse_batch
from qosgate.sim.report import document, dumps, ledger_ok, write_files
from qosgate.sim.report_tables import print_report
from qosgate.sim.scenario_file import (
    ScenarioError,
    arrival_changes,
    available_scenarios,
    describe,
    load_scenario,
    override,
)
from qosgate.sim.scenarios import Run, prepare, run_scenario
from qosgate.sim.setup import SIM_POLICIES

_DEFAULT_PREFILL_BUDGET = Fleet.model_fields["prefill_budget_tokens"].default


def simulate_command(
    scenario: Annotated[
        str,
        typer.Option(
            "--scenario",
            "-s",
            help=f"Built-in scenario ({', '.join(available_scenarios())}) or a YAML file.",
        ),
    ] = "seed-classes",
    policies: Annotated[
        str | None,
        typer.Option(help=f"Comma-separated, from: {', '.join(SIM_POLICIES)}."),
    ] = None,
    seed: Annotated[int | None, typer.Option(help="Workload seed.")] = None,
    profile: Annotated[str | None, typer.Option(help="Engine profile name or YAML file.")] = None,
    replicas: Annotated[int | None, typer.Option(min=1, help="Engine replicas.")] = None,
    window: Annotated[
        int | None, typer.Option(min=1, help="qosgate window per replica (default: auto).")
    ] = None,
    window_mode: Annotated[
        str | None,
        typer.Option(
            "--window-mode",
            help="fixed | adaptive: the core's window per replica (adaptive: --window or auto is "
            "its ceiling). Default: the scenario's (unset: fixed for pausable replicas).",
        ),
    ] = None,
    load: Annotated[
        float | None,
        typer.Option(help="Offered load (x capacity); replaces a scenario's sweep."),
    ] = None,
    time_scale: Annotated[
        float | None, typer.Option(help="Trace replay speed-up (2 = twice the load).")
    ] = None,
    duration: Annotated[
        float | None, typer.Option(help="Arrival window in virtual seconds.")
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(help="Trace: an Azure LLM CSV or a Mooncake JSONL (default: the "
                     "scenario's, from shared/traces/)."),
    ] = None,
    out: Annotated[
        Path | None, typer.Option(help="Directory for the JSON, CSV and PNG files.")
    ] = None,
    plots: Annotated[bool | None, typer.Option(
        "--plots/--no-plots", show_default=False,
        help="Write PNG plots with --out (default: if qosgate[plots] is installed)."),
    ] = None,
    json_only: Annotated[
        bool, typer.Option("--json-only", help="Print only the JSON document on stdout.")
    ] = False,
    quiet: Annotated[
        bool, typer.Option("--quiet", "-q", help="No progress bar and no tables.")
    ] = False,
    gateways: Annotated[
        str | None,
        typer.Option(
            "--gateways",
            help="Gateway instances in front of the one fleet, e.g. 4, or 1,2,4 (one run per "
            "count and policy). Default: the scenario's (unset: 1).",
        ),
    ] = None,
    spread: Annotated[
        str | None,
        typer.Option(help="How arrivals reach the gateways: round-robin | hash | skewed."),
    ] = None,
    shared_state: Annotated[
        bool | None,
        typer.Option(
            "--shared-state/--no-shared-state",
            help="Several gateways share tenant state (limits, fair-share counters) through "
            "the shared-state protocol (core/shared.py) over an in-memory store, or each keeps "
            "its own.",
        ),
    ] = None,
    sync_interval_s: Annotated[
        float | None,
        typer.Option("--sync-interval-s", min=1e-4, help="Shared-state sync interval (virtual s)."),
    ] = None,
    sync_delay_s: Annotated[
        float | None,
        typer.Option("--sync-delay-s", min=0.0, help="Each store call answers this much later."),
    ] = None,
    retries: Annotated[
        int | None,
        typer.Option(
            "--retries", min=0, max=20,
            help="Clients honour a refusal's Retry-After: each refused request is sent again "
            "that much later, up to N times (default: the scenario's, unset 0).",
        ),
    ] = None,
    router: Annotated[
        str | None,
        typer.Option("--router", help="fleet.router for every gateway, from: "
                     f"{', '.join(ROUTERS)} (default least-load); several, comma-separated: "
                     "one run per router, side by side."),
    ] = None,
    tpot_guard: Annotated[
        str | None,
        typer.Option("--tpot-guard", help="fleet.tpot_guard: off (the default), auto, or a "
                     "fraction of realtime's TPOT budget such as 0.6 "
                     "(docs/experiments/tpot-guard.md)."),
    ] = None,
    prefill_budget: Annotated[
        str | None,
        typer.Option("--prefill-budget", help="fleet.prefill_budget_tokens: a token count "
                     f"(default {_DEFAULT_PREFILL_BUDGET}) or off "
                     "(docs/experiments/tpot-guard.md)."),
    ] = None,
    job: Annotated[
        list[str] | None,
        typer.Option("--job", help="A batch job beside the live workload: "
                     "LINES[@START][/WINDOW][,class=C][,tenant=T][,prompt=N][,output=N], e.g. "
                     "20000@0s/1h,class=offline (start and window in s, m, h or d; default 0 "
                     "and 24h; lengths default to the scenario's). Repeat for several; replaces "
                     "the scenario's jobs. Each policy then runs without and with them."),
    ] = None,
    list_scenarios: Annotated[
        bool, typer.Option("--list", help="List the built-in scenarios and exit.")
    ] = False,
) -> None:
    """Compare policies on a workload in virtual time (the gateway's core and engine model)."""
    console = Console()
    if not console.is_terminal:  # redirected: do not squeeze the tables into 80 columns
        console = Console(width=150)
    err = Console(stderr=True)
    if list_scenarios:
        for name in available_scenarios():
            sc = load_scenario(name)
            console.print(f"[bold]{name}[/bold]: {describe(sc)}")
        return
    try:
        sc = load_scenario(scenario)
        given = {
            "seed": seed,
            "profile": profile,
            "replicas": replicas,
            "window": window,
            "window_mode": window_mode,
            "duration_s": duration,
            "retries": retries,
        }
        changes: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        if policies is not None:
            changes["policies"] = [p.strip() for p in policies.split(",") if p.strip()]
            if not changes["policies"]:
                raise ScenarioError(
                    f"--policies names no policy: give one or more of {', '.join(SIM_POLICIES)}"
                )
        changes.update(arrival_changes(time_scale, load))
        gw: dict[str, Any] = {}
        if gateways is not None:
            try:
                gw["counts"] = [int(x) for x in gateways.split(",") if x.strip()]
            except ValueError:
                raise ScenarioError(
                    f"--gateways {gateways!r}: give counts like 4 or 1,2,4"
                ) from None
            if not gw["counts"]:
                raise ScenarioError("--gateways names no count")
        for key, val in (("spread", spread), ("shared", shared_state),
                         ("sync_interval_s", sync_interval_s), ("sync_delay_s", sync_delay_s)):
            if val is not None:
                gw[key] = val
        if gw:
            changes["gateways"] = {**sc.gateways.model_dump(), **gw}
        fleet: dict[str, Any] = {}
        routers = [r.strip() for r in (router or "").split(",") if r.strip()]
        if router is not None and not routers:
            raise ScenarioError(f"--router names no router: give one or more of "
                                f"{', '.join(ROUTERS)}")
        if len(routers) == 1:
            fleet["router"] = routers[0]
            if sc.routers:  # one router given replaces the scenario's list
                changes["routers"] = []
        elif routers:
            changes["routers"] = routers
        if tpot_guard is not None:
            fleet["tpot_guard"] = None if tpot_guard == "off" else tpot_guard
        if prefill_budget is not None:
            fleet["prefill_budget_tokens"] = None if prefill_budget == "off" else prefill_budget
        if fleet:
            config = dict(sc.config)
            config["fleet"] = {**dict(config.get("fleet", {})), **fleet}
            changes["config"] = config
        if job:
            changes["jobs"] = [parse_batch(text).model_dump(by_alias=True, exclude_none=True)
                               for text in job]
        if changes:
            sc = override(sc, **changes)
        prep = prepare(sc, trace)
    except (ScenarioError, ValueError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None

    if out is not None and plots is not False and missing(*PLOTS.modules):
        if plots:  # asked for: say so before the runs, not after
            err.print(f"--plots needs matplotlib: `{PLOTS.pip}` (or --no-plots)", style="red",
                      markup=False, soft_wrap=True)
            raise typer.Exit(2)
        plots = False
        if not (quiet or json_only):
            err.print(f"no plots: `{PLOTS.pip}` writes them", markup=False, soft_wrap=True)
    n_loads = len(sc.sweep.loads) if sc.sweep else 1
    total_runs = (n_loads * len(sc.gateways.counts) * len(prep.configs()) * len(sc.policies)
                  * (2 if prep.jobs else 1))
    show = not (quiet or json_only)
    started = time.perf_counter()
    done_runs = 0
    simulated = 0

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not show or not err.is_terminal,
    )

    with progress:
        task = progress.add_task(sc.name, total=total_runs)

        def on_progress(policy: str, ld: float | None, frac: float) -> None:
            label = f"{sc.name}: {policy}" + (f" @ {100 * ld:.0f}%" if ld is not None else "")
            progress.update(task, completed=done_runs + frac, description=label)

        def on_run(run: Run) -> None:
            nonlocal done_runs, simulated
            done_runs += 1
            simulated += run.result.arrivals
            progress.update(task, completed=done_runs)

        try:
            res = run_scenario(prep, on_progress, on_run)
        except ScenarioError as exc:  # e.g. a sweep load no workload can be drawn for
            progress.stop()
            err.print(f"[red]{exc}[/red]")
            raise typer.Exit(2) from None
    wall = time.perf_counter() - started

    doc = document(res)
    if json_only:
        sys.stdout.write(dumps(doc))
    elif not quiet:
        print_report(res, console)
        console.print(
            f"[dim]{total_runs} run(s), {simulated} simulated requests in {wall:.1f} s wall "
            f"({simulated / wall if wall > 0 else 0:.0f} requests/s)[/dim]",
            highlight=False,
        )
    if out is not None:
        paths = write_files(res, out, doc)
        if plots is not False:
            from qosgate.sim.plots import write_plots

            paths += write_plots(res, out)
        if not (json_only or quiet):
            for p in paths:
                console.print(f"wrote {p}")
    if not ledger_ok(res):
        err.print("[red]the outcome ledger does not balance: some request has no outcome[/red]")
        raise typer.Exit(1)
