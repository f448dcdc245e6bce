"""The fit's outputs: the per-measurement error table, and the profile YAML the simulator loads
(``qosgate simulate --profile FILE``, ``models.simmodel.load_profile``)."""

from __future__ import annotations

import statistics
from pathlib import Path

import yaml
from rich.table import Table

from qosgate.calibrate.fit import Fit
from qosgate.calibrate.probe import Capacity
from qosgate.models.simmodel import EngineProfile


def error_table(f: Fit) -> Table:
    """Measured vs modelled, per measurement, with the relative error."""
    t = Table(title="calibration: measured vs modelled")
    for head in ("measurement", "kind", "measured ms", "modelled ms", "error"):
        t.add_column(head, justify="left" if head == "measurement" else "right")
    for o, e in zip(f.observations, f.errors(), strict=True):
        t.add_row(o.label, o.kind.upper(), f"{o.measured_s * 1000:.2f}",
                  f"{f.modelled(o) * 1000:.2f}", f"{e:+.1%}")
    return t


def summary(f: Fit) -> str:
    errs = [abs(e) for e in f.errors()]
    return (f"{len(errs)} measurements: |error| median {statistics.median(errs):.1%}, "
            f"max {max(errs):.1%}")


def coefficient_table(f: Fit, reference: EngineProfile | None = None) -> Table:
    """The fitted coefficients (and a reference profile's beside them, to compare)."""
    t = Table(title="fitted step model")
    t.add_column("coefficient")
    t.add_column("fitted", justify="right")
    if reference is not None:
        t.add_column(reference.name, justify="right")
        t.add_column("ratio", justify="right")
    for name, v in f.coef.items():
        cells = [name, f"{v:.4g}" + (" (not identified)" if name in f.unidentified else "")]
        if reference is not None:
            ref = getattr(reference, name, None)
            cells += ["-", "-"] if ref is None else [
                f"{ref:.4g}", f"{v / ref:.3f}" if ref else "-"]
        t.add_row(*cells)
    return t


def _sig(v: float) -> float:
    """Four significant digits: the fit is not better than that, and the YAML stays readable."""
    return float(f"{v:.4g}")


def build_profile(f: Fit, cap: Capacity, name: str, model: str, gpu: str,
                  source: str) -> EngineProfile:
    return EngineProfile(
        name=name, model=model, gpu=gpu, source=source,
        step_fixed_s=_sig(f.coef["step_fixed_s"]),
        prefill_s_per_token=_sig(f.coef["prefill_s_per_token"]),
        prefill_s_per_ctx_token=_sig(f.coef["prefill_s_per_ctx_token"]),
        decode_s_per_ctx_token=_sig(f.coef["decode_s_per_ctx_token"]),
        decode_s_per_seq=_sig(f.coef["decode_s_per_seq"]),
        max_num_seqs=cap.max_num_seqs,
        max_num_batched_tokens=cap.max_num_batched_tokens,
        kv_capacity_tokens=cap.kv_capacity_tokens,
    )


def write_profile(path: Path, profile: EngineProfile, f: Fit) -> None:
    """The profile as YAML, its fit's measurements and errors as comments above it."""
    lines = [f"# Written by `qosgate calibrate`. {summary(f)}.",
             f"# Client-side overhead on TTFT (HTTP, tokenizing; not in the engine model): "
             f"{f.coef['overhead_s'] * 1000:.2f} ms."]
    if f.unidentified:
        lines.append(f"# Not identified by the probe (left at 0): {', '.join(f.unidentified)}.")
    lines.append("# measurement: measured ms, modelled ms, relative error")
    for o, e in zip(f.observations, f.errors(), strict=True):
        lines.append(f"#   {o.label}: {o.measured_s * 1000:.2f}, "
                     f"{f.modelled(o) * 1000:.2f}, {e:+.1%}")
    data = profile.model_dump(exclude_defaults=False)
    for k in ("kv_bytes_per_token", "host_kv_tokens", "host_load_s_per_token"):
        data.pop(k, None)  # not measured: the defaults (no host tier)
    body = yaml.safe_dump(data, sort_keys=False, width=100)
    path.write_text("\n".join(lines) + "\n" + body, encoding="utf-8")
