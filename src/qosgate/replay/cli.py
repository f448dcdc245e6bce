"""``qosgate replay URL``: a workload sent in real time to an OpenAI-compatible endpoint,
reported per class as ``qosgate simulate`` reports (the same tables and JSON document)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
import sys
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from qosgate.flags import flag_keys
from qosgate.replay.compare import compare_table, comparison, predict
from qosgate.replay.plan import Planned, plan_workload, read_requests
from qosgate.replay.record import measured
from qosgate.replay.runner import Attempt, Target, replay
from qosgate.sim.flags import REPLAY_FLAGS, with_keys
from qosgate.sim.fmt import num
from qosgate.sim.report import document, dumps
from qosgate.sim.report_tables import print_tables
from qosgate.sim.scenario_file import (
    ScenarioError,
    available_scenarios,
    load_scenario,
)
from qosgate.sim.scenarios import Prepared, prepare, workload_for
from qosgate.sim.workload import Workload

# a 400 naming one of these fields: the endpoint does not take what the replay sent there
WAYS_AROUND = {"ignore_eos": "--no-ignore-eos", "prompt": "--text-prompts"}


def check_host(url: str, allowed: list[str]) -> str:
    """The base URL, if its host is a loopback address or one given with ``--allow-host``."""
    if "://" not in url:
        url = "http://" + url
    host = urlsplit(url).hostname or ""
    if host not in allowed and host != "localhost":
        try:
            ok = ipaddress.ip_address(host).is_loopback
        except ValueError:
            ok = False
        if not ok:
            raise ScenarioError(f"{host!r} is not a loopback address: pass --allow-host {host} "
                                "to send this workload to it")
    return url.rstrip("/")


def served_model(url: str, key: str | None) -> str:
    """The first model the endpoint lists (``GET /v1/models``), asked with the key the
    workload's first request sends: so that an endpoint refusing that key stops the replay
    before it sends anything, with its status and its words, not after a whole run of 401s."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    req = urllib.request.Request(url + "/v1/models", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return str(json.loads(r.read())["data"][0]["id"])
    except urllib.error.HTTPError as exc:
        said = _error_message(exc.read())
        if exc.code in (401, 403):
            how = ("with the key " + _masked(key)) if key else "with no key"
            raise ScenarioError(
                f"{url} refused the replay's requests {how}: HTTP {exc.code}{said}. Pass the "
                "endpoint's key with --api-key (or QOSGATE_REPLAY_API_KEY), or a scenario whose "
                "tenants carry its keys.") from None
        raise ScenarioError(f"{url}/v1/models answered HTTP {exc.code}{said}") from None


def _error_message(body: bytes) -> str:
    """``: <message>`` of an OpenAI error body, or nothing."""
    try:
        doc = json.loads(body)
        return f": {doc['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return ""


def _masked(key: str) -> str:
    return key[:3] + "…" if len(key) > 6 else "…"


def failures_by_status(attempts: list[Attempt]) -> Counter[tuple[int, str]]:
    """The attempts that got an HTTP error other than a refusal with ``Retry-After`` (429/503:
    the refusals table), by (status, code): a 401 is an authentication failure, said so, not a
    bare "fail"."""
    return Counter((a.answer.status, a.answer.reason)
                   for a in attempts if a.answer.status >= 400
                   and a.answer.status not in (429, 503))


def bounded(wl: Workload, max_requests: int, max_seconds: float) -> Workload:
    """The workload cut to its first ``max_requests`` arrivals and ``max_seconds``; the arrival
    window ends where the cut falls."""
    arr = [a for a in wl.arrivals if a.t < max_seconds][:max_requests]
    if len(arr) == len(wl.arrivals):
        end = min(wl.duration, max_seconds)
    else:
        nxt = wl.arrivals[len(arr)].t if len(arr) < len(wl.arrivals) else wl.duration
        end = min(nxt, max_seconds, wl.duration)
    return replace(wl, arrivals=tuple(arr), duration=end,
                   rate=len(arr) / end if end > 0 else 0.0)


def refusals_table(rows: list[dict[str, Any]]) -> Table:
    t = Table(title="refusals by reason and status", title_justify="left")
    for col in ("class", "reason", "status", "count", "with Retry-After", "Retry-After p50",
                "max"):
        t.add_column(col, justify="left" if col in ("class", "reason") else "right")
    for r in rows:
        t.add_row(r["class"], r["reason"], str(r["status"]), str(r["count"]),
                  str(r["with_retry_after"]), num(r["retry_after_p50_s"], ".1f") + " s",
                  num(r["retry_after_max_s"], ".1f") + " s")
    return t


def _prepared(scenario: str, trace: Path | None, keys: dict[str, Any]) -> Prepared:
    # the replay sends the live workload alone: faults and batch jobs are the simulator's; its
    # engines are real ones, whose priority queue never preempts (vLLM 0.32, ``SimEngine``)
    keys = {"engine_preempts": False, **keys, "faults": [], "jobs": []}
    return prepare(with_keys(load_scenario(scenario), keys), trace)


def _send(plan: list[Planned], target: Target, show: bool, err: Console) -> list[Attempt]:
    """The requests sent, under a progress bar on a terminal; every attempt, in sending order."""
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), console=err,
                        transient=True, disable=not show or not err.is_terminal)
    with progress:
        task = progress.add_task(f"replay → {target.url}", total=len(plan))

        def on(sent: int, done: int) -> None:
            progress.update(task, completed=done, total=max(sent, len(plan)),
                            description=f"replay → {target.url}: {sent} sent")

        return asyncio.run(replay(plan, target, on))


def replay_command(
    ctx: typer.Context,
    url: Annotated[str, typer.Argument(help="Base URL of an OpenAI-compatible endpoint.")],
    scenario: Annotated[str, typer.Option(
        "--scenario", "-s",
        help=f"Built-in scenario ({', '.join(available_scenarios())}) or a YAML file: the "
        "workload, its classes, tenants and keys, SLOs.")] = "seed-classes",
    trace: Annotated[Path | None, typer.Option(
        help="Trace: an Azure LLM CSV or a Mooncake JSONL (default: the scenario's).")] = None,
    requests: Annotated[Path | None, typer.Option(
        "--requests", help="A JSONL of requests (t, prompt_tokens, output_tokens, class, "
        "tenant or api_key) instead of the scenario's arrivals; classes, keys and SLOs stay "
        "the scenario's.")] = None,
    load: Annotated[float | None, typer.Option(
        help="Offered load (x the scenario's modelled capacity).")] = None,
    time_scale: Annotated[float | None, typer.Option(help="Trace replay speed-up.")] = None,
    duration: Annotated[float | None, typer.Option(help="Arrival window in seconds.")] = None,
    seed: Annotated[int | None, typer.Option(help="Workload seed.")] = None,
    profile: Annotated[str | None, typer.Option(
        help="Engine profile the scenario's capacity (--load) is measured on: the rate sent "
        "is --load times that capacity, so for a CPU engine give its profile (`qosgate "
        "calibrate`) or a rate of its own (--requests).")] = None,
    replicas: Annotated[int | None, typer.Option(
        min=1, help="Replicas behind the URL (for --load's capacity and --compare-sim).")] = None,
    window: Annotated[int | None, typer.Option(
        min=1, help="The gateway's window per replica (its upstreams' max_window), for --load's "
        "capacity and --compare-sim (default: the scenario's, auto).")] = None,
    embedded: Annotated[bool, typer.Option(
        "--embedded/--upstreams", help="What --compare-sim models behind the URL: upstream "
        "servers (vLLM over HTTP: qosgate can pull a request back only by abort, and sizes "
        "their windows by fleet.window.mode) or qosgate's embedded engine (pausable, fixed "
        "window).")] = False,
    window_mode: Annotated[str | None, typer.Option(
        "--window-mode", help="fixed | adaptive, as the gateway's fleet.window.mode (for "
        "--compare-sim; default: the scenario's).")] = None,
    model: Annotated[str | None, typer.Option(
        help="Model name to ask for (default: the endpoint's first in /v1/models).")] = None,
    token_prompts: Annotated[bool, typer.Option(
        "--token-prompts/--text-prompts",
        help="Exact prompt lengths as token ids on /v1/completions (vLLM, qosgate), or text "
        "of about the right length on /v1/chat/completions.")] = True,
    prompt_seed: Annotated[str | None, typer.Option(
        help="Seed of the prompts' tokens. Default: a new one each run, so no replay finds "
        "another's prompts in the engine's prefix cache; give the one a report names to send "
        "the same bytes again.")] = None,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos/--no-ignore-eos", help="Ask for exactly the workload's output length "
        "(ignore_eos). An engine that refuses the field (qosgate's embedded llama.cpp) answers "
        "400: replay it with --no-ignore-eos; outputs may then end early.")] = True,
    retries: Annotated[int, typer.Option(
        min=0, max=20, help="Send a refused request again after its Retry-After, up to N "
        "times.")] = 0,
    max_requests: Annotated[int, typer.Option(
        min=1, help="Send at most this many requests (first attempts).")] = 2000,
    max_seconds: Annotated[float, typer.Option(
        min=0.1, help="Stop after this long: requests still running are cancelled.")] = 600.0,
    request_timeout: Annotated[float, typer.Option(
        min=0.1, help="Give up on one request after this long.")] = 600.0,
    api_key: Annotated[str | None, typer.Option(
        "--api-key", envvar="QOSGATE_REPLAY_API_KEY", show_envvar=True,
        help="Send every request with this key (Authorization: Bearer), instead of the "
        "scenario's tenants' keys.")] = None,
    allow_host: Annotated[list[str] | None, typer.Option(
        "--allow-host", help="A non-loopback host the workload may be sent to.")] = None,
    compare_sim: Annotated[str | None, typer.Option(
        "--compare-sim", help="Engine profile (name or YAML): simulate the same requests and "
        "print measured vs predicted with the relative error.")] = None,
    engine_queue: Annotated[str | None, typer.Option(
        "--engine-queue", help="auto | fcfs | priority: the engines' own queue --compare-sim "
        "models. auto: priority behind a qos gateway, as with its upstreams' priority_polarity "
        "vllm (or sglang); give fcfs for a gateway that strips the priority (polarity none, "
        "the default) or an engine without priority scheduling.")] = None,
    sim_policy: Annotated[str, typer.Option(
        help="The policy --compare-sim simulates: qos behind qosgate, fifo for a raw "
        "engine.")] = "qos",
    out: Annotated[Path | None, typer.Option(help="Write the JSON document here.")] = None,
    json_only: Annotated[bool, typer.Option(
        "--json-only", help="Print only the JSON document on stdout.")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, no tables.")
                     ] = False,
) -> None:
    """Replay a workload in real time against an endpoint and report it per class."""
    console = Console()
    if not console.is_terminal:
        console = Console(width=150)
    err = Console(stderr=True)
    try:
        base = check_host(url, allow_host or [])
        prep = _prepared(scenario, trace, flag_keys(REPLAY_FLAGS, ctx.params))
        wl = read_requests(requests, prep) if requests else workload_for(prep, load)
        wl = bounded(wl, max_requests, max_seconds)
        plan: list[Planned] = plan_workload(prep, wl)
        if not plan:
            raise ScenarioError("the workload has no request to send")
        if api_key is not None:
            plan = [replace(p, api_key=api_key) for p in plan]
        listed = served_model(base, plan[0].api_key)  # the key checked, with --model too
        name = model or listed
    except (ScenarioError, ValueError, OSError) as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    seed_of_prompts = prompt_seed if prompt_seed is not None else secrets.token_hex(4)
    target = Target(base, name, token_prompts, retries, max_seconds, request_timeout,
                    seed_of_prompts, ignore_eos)
    show = not (quiet or json_only)
    attempts = _send(plan, target, show, err)
    load_x = wl.rate / prep.capacity_rps if prep.capacity_rps else None
    res = measured(prep, attempts, [s.label() for s in wl.streams], wl.duration, wl.rate,
                   load_x)
    doc = document(res)
    run = res.runs[0]
    short = sum(1 for a in attempts if a.answer.state == "completed"
                and a.answer.output_tokens < a.planned.output)
    # 400s naming a field the replay chose: the endpoint does not take it (a flag says how not
    # to send it)
    unsupported = Counter(a.answer.param for a in attempts
                          if a.answer.status == 400 and a.answer.param in WAYS_AROUND)
    failures = failures_by_status(attempts)
    doc["replay"] = {"url": base, "model": name, "token_prompts": token_prompts,
                     "retries": retries, "planned": len(plan),
                     "prompt_seed": seed_of_prompts, "ignore_eos": ignore_eos,
                     "short_outputs": short, "unsupported_fields": dict(unsupported),
                     "refusals": run.metrics["refusals"],
                     "rate_rps": wl.rate, "profile": prep.profile.name,
                     "failures": [{"status": st, "code": code, "count": n}
                                  for (st, code), n in sorted(failures.items())]}
    if compare_sim is not None:
        pred = predict(prep, wl, compare_sim, sim_policy, replicas)
        doc["compare_sim"] = {"profile": compare_sim, "policy": sim_policy,
                              "classes": comparison(run, pred)}
    if json_only:
        sys.stdout.write(dumps(doc))
    elif not quiet:
        console.print(f"[bold]replay[/bold] of {prep.scenario.name} → {base} (model {name}, "
                      f"{'token-id' if token_prompts else 'text'} prompts)", highlight=False)
        print_tables(res, console)
        if run.metrics["refusals"]:
            console.print(refusals_table(run.metrics["refusals"]))
        for (status, code), n in sorted(failures.items()):
            what = ("authentication failed: pass the endpoint's key with --api-key"
                    if status in (401, 403) else "failed")
            console.print(f"[red]{n} request(s) got HTTP {status}"
                          + (f" {code}" if code else "") + f" ({what}).[/red]")
        for param, n in sorted(unsupported.items()):
            console.print(f"[red]{n} request(s) were refused because the endpoint does not take "
                          f"their {param} (400, param {param}): replay with "
                          f"{WAYS_AROUND[param]}.[/red]")
        if short:
            console.print(f"[yellow]{short} completed request(s) got fewer tokens than their "
                          "max_tokens: the engine stopped at its end-of-sequence token (it does "
                          "not honour ignore_eos). Their TPOT is over the tokens they got; "
                          "their E2E is shorter than the workload's.[/yellow]")
        if compare_sim is not None:
            console.print(compare_table(doc["compare_sim"]["classes"], compare_sim))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(dumps(doc), encoding="utf-8")
        if show:
            console.print(f"wrote {out}")
