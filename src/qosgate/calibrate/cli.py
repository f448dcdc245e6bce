"""``qosgate calibrate URL``: probe, fit, print the error, write the profile."""

from __future__ import annotations

import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import typer
import yaml
from rich.console import Console

from qosgate.calibrate.engine import HttpEngine, ProbeError
from qosgate.calibrate.fit import fit
from qosgate.calibrate.probe import Capacity, Probe, default_plan, describe
from qosgate.calibrate.report import (
    build_profile,
    coefficient_table,
    error_table,
    summary,
    write_profile,
)
from qosgate.models.simmodel import load_profile


def _limit(value: int | None, found: int | None, flag: str, what: str) -> int:
    """A capacity figure: the flag, else what the engine said, else asked (on a terminal)."""
    if value is not None:
        return value
    if found is not None:
        return found
    if sys.stdin.isatty():
        return int(typer.prompt(f"{what} (the engine does not publish it; {flag})", type=int))
    raise typer.BadParameter(f"the engine does not publish it: give {flag}", param_hint=flag)


def calibrate_command(
    url: Annotated[str, typer.Argument(help="The engine's base URL (OpenAI-compatible).")],
    out: Annotated[Path | None, typer.Option(
        help="Write the profile here (YAML; `qosgate simulate --profile FILE`). "
        "Default: printed.")] = None,
    model: Annotated[str | None, typer.Option(
        help="Model to probe (default: the first of /v1/models).")] = None,
    max_num_seqs: Annotated[int | None, typer.Option(
        min=1, help="The engine's max_num_seqs (vLLM's --max-num-seqs).")] = None,
    max_num_batched_tokens: Annotated[int | None, typer.Option(
        min=1, help="The engine's token budget per step (vLLM's --max-num-batched-tokens).")
    ] = None,
    kv_capacity_tokens: Annotated[int | None, typer.Option(
        min=1, help="KV cache size in tokens (default: vLLM's /metrics cache_config_info, "
        "num_gpu_blocks x block_size).")] = None,
    name: Annotated[str | None, typer.Option(help="The profile's name.")] = None,
    gpu: Annotated[str, typer.Option(help="The profile's gpu field.")] = "unknown",
    time_limit: Annotated[float, typer.Option(
        min=5, help="Seconds the probe may take (runs that would pass it are skipped).")] = 110.0,
    tokens: Annotated[int, typer.Option(
        min=16, help="Most tokens per decode request (fewer on a slow engine).")] = 64,
    max_batch: Annotated[int, typer.Option(min=1, help="Largest decode batch probed.")] = 64,
    compare: Annotated[str | None, typer.Option(
        help="A profile (name or file) to print beside the fit.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the prompts' token ids.")] = 0,
) -> None:
    """Fit an engine profile for the simulator from a short probe of a live engine: prefill at a
    few prompt lengths, decode at a few batch sizes (streamed /v1/completions, token-id prompts,
    ignore_eos). Prints the fit's error per measurement and writes the profile."""
    console = Console()
    base = url if "://" in url else "http://" + url
    base = base.rstrip("/")
    reference = load_profile(compare) if compare else None
    try:
        ep = describe(base)
    except ProbeError as exc:
        console.print(f"[red]{exc}[/red]")
        raise typer.Exit(1) from None
    probe_model = model or ep.model
    if not probe_model:
        raise typer.BadParameter("/v1/models lists no model: give --model", param_hint="--model")
    cap = Capacity(
        _limit(max_num_seqs, None, "--max-num-seqs", "max_num_seqs"),
        _limit(max_num_batched_tokens, None, "--max-num-batched-tokens",
               "max_num_batched_tokens"),
        _limit(kv_capacity_tokens, ep.kv_capacity_tokens, "--kv-capacity-tokens",
               "kv_capacity_tokens"),
    )
    plan = default_plan(cap, ep.max_model_len, time_limit, max_batch)
    plan.tokens = tokens
    console.print(f"probing {base} ({probe_model}): prefill {plan.prefill_lengths} tokens, "
                  f"decode n={plan.batch_sizes} at prompts {plan.decode_prompts}; "
                  f"at most {time_limit:g} s")
    probe = Probe(HttpEngine(base, probe_model), cap, plan, say=console.print, seed=seed)
    began = time.monotonic()
    try:
        obs = probe.run()
    except (ProbeError, OSError) as exc:
        console.print(f"[red]probe failed: {exc}[/red]")
        raise typer.Exit(1) from None
    took = time.monotonic() - began
    if probe.skipped:
        console.print(f"skipped: {', '.join(probe.skipped)}")
    result = fit(obs)
    console.print(error_table(result))
    console.print(coefficient_table(result, reference))
    console.print(f"{summary(result)}; probe {took:.1f} s; overhead on TTFT (not in the "
                  f"profile) {result.coef['overhead_s'] * 1000:.2f} ms")
    host = urlsplit(base).netloc
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    profile = build_profile(
        result, cap, name or f"calibrated-{host.replace(':', '-')}", probe_model, gpu,
        f"fitted by qosgate calibrate against {base} ({probe_model}) on {when}: "
        f"{summary(result)}")
    if out is None:
        console.print(yaml.safe_dump(profile.model_dump(), sort_keys=False), markup=False)
    else:
        write_profile(out, profile, result)
        console.print(f"profile written to {out} (qosgate simulate --profile {out})")
