"""An engine's ``/metrics`` (Prometheus text exposition) read into ``LoadSignals``.

Pure: text in, ``LoadSignals`` out, nothing fetched and no clock read (the caller passes ``at``).
The engines and their names (vLLM's as checked against a running vLLM 0.32 in ``tests/e2e/vllm``):

- running: ``vllm:num_requests_running``, ``sglang:num_running_reqs``,
  ``llamacpp:requests_processing``;
- waiting (the engine's own queue): ``vllm:num_requests_waiting``, ``sglang:num_queue_reqs``,
  ``llamacpp:requests_deferred``;
- kv_usage: ``vllm:kv_cache_usage_perc``, ``sglang:token_usage``,
  ``llamacpp:kv_cache_usage_ratio``;
- preemptions_total: ``vllm:num_preemptions_total``, ``sglang:num_retracted_requests_total``
  (llama.cpp server exports none);
- itl_seconds_total / itl_tokens_total: ``vllm:inter_token_latency_seconds_sum`` / ``_count``
  (vLLM only here);
- prompt_tokens_total / output_tokens_total (the engine's progress: ``core/progress.py``):
  ``vllm:prompt_tokens_total`` / ``vllm:generation_tokens_total``, SGLang's names alike,
  ``llamacpp:prompt_tokens_total`` / ``llamacpp:tokens_predicted_total``;
- adapters / adapter_capacity: the LoRA adapters a vLLM holds, from ``vllm:lora_requests_info``
  (its labels, not its value: ``wire/lora_info.py``).

Units: every KV figure is a **fraction 0..1** (vLLM's ``_perc`` despite its name; the older
``vllm:gpu_cache_usage_perc`` is read when the new name is absent). SGLang builds that export
``sglang_``-prefixed names (underscore) are read too. SGLang's ``sglang:num_retracted_reqs`` is a
gauge of the last batch, not a counter, and is deliberately not used.

Several label sets of one name (several ``model_name``s, vLLM's data-parallel ``engine``s, SGLang's
``dp_rank``s) are **summed** for the counts, and the **largest** is taken for ``kv_usage`` (a sum of
fractions means nothing; the fullest cache is the one that preempts first). A name the text does
not carry leaves its field None. Lines that do not parse are skipped, not fatal: a scrape is a
hint, and one odd line must not blind the gateway to the rest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from qosgate.core.signals import LoadSignals
from qosgate.wire.lora_info import NAME as LORA_INFO
from qosgate.wire.lora_info import loaded_adapters

# (field, candidate names in order of preference); the first name present wins
_Spec = tuple[tuple[str, tuple[str, ...]], ...]

VLLM: _Spec = (
    ("running", ("vllm:num_requests_running",)),
    ("waiting", ("vllm:num_requests_waiting",)),
    ("kv_usage", ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")),
    ("preemptions_total", ("vllm:num_preemptions_total",)),
    ("itl_seconds_total", ("vllm:inter_token_latency_seconds_sum",)),
    ("itl_tokens_total", ("vllm:inter_token_latency_seconds_count",)),
    ("prompt_tokens_total", ("vllm:prompt_tokens_total",)),
    ("output_tokens_total", ("vllm:generation_tokens_total",)),
)
SGLANG: _Spec = (
    ("running", ("sglang:num_running_reqs", "sglang_num_running_reqs")),
    ("waiting", ("sglang:num_queue_reqs", "sglang_num_queue_reqs")),
    ("kv_usage", ("sglang:token_usage", "sglang_token_usage")),
    (
        "preemptions_total",
        ("sglang:num_retracted_requests_total", "sglang_num_retracted_requests_total"),
    ),
    ("prompt_tokens_total", ("sglang:prompt_tokens_total", "sglang_prompt_tokens_total")),
    ("output_tokens_total", ("sglang:generation_tokens_total", "sglang_generation_tokens_total")),
)
LLAMACPP: _Spec = (
    ("running", ("llamacpp:requests_processing",)),
    ("waiting", ("llamacpp:requests_deferred",)),
    ("kv_usage", ("llamacpp:kv_cache_usage_ratio",)),
    ("prompt_tokens_total", ("llamacpp:prompt_tokens_total",)),
    ("output_tokens_total", ("llamacpp:tokens_predicted_total",)),
)
SPECS: Mapping[str, _Spec] = {"vllm": VLLM, "sglang": SGLANG, "llamacpp": LLAMACPP}
_WANTED = frozenset(n for spec in SPECS.values() for _, names in spec for n in names)


def _sample(line: str) -> tuple[str, float] | None:
    """``name{labels} value [timestamp]`` -> (name, value); None for anything else."""
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        name = line[:brace]
        # the label block ends at the first '}' outside a quoted value
        i, quoted = brace + 1, False
        while i < len(line):
            c = line[i]
            if quoted:
                if c == "\\":
                    i += 1
                elif c == '"':
                    quoted = False
            elif c == '"':
                quoted = True
            elif c == "}":
                break
            i += 1
        else:
            return None
        rest = line[i + 1 :]
    else:
        if space == -1:
            return None
        name, rest = line[:space], line[space:]
    parts = rest.split()
    if not name or not parts:
        return None
    try:
        value = float(parts[0])  # also "NaN", "+Inf", "-Inf"
    except ValueError:
        return None
    return name.strip(), value


def samples_by_name(text: str, names: Iterable[str] | None = None) -> dict[str, list[float]]:
    """Every sample value of each wanted metric name, over all its label sets, in text order."""
    wanted = _WANTED if names is None else frozenset(names)
    prefixes = tuple(wanted)
    out: dict[str, list[float]] = {}
    for raw in text.split("\n"):  # not splitlines(): a label value may hold \x1e, \u2028, ...
        line = raw.strip(" \t\r")
        if not line.startswith(prefixes):  # comments, blank lines, the many other families
            continue
        s = _sample(line)
        if s is None or s[0] not in wanted:
            continue
        out.setdefault(s[0], []).append(s[1])
    return out


def _count(values: list[float]) -> int | None:
    finite = [v for v in values if math.isfinite(v)]
    return round(sum(finite)) if finite else None


def _total(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) if finite else None


def _fraction(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return min(1.0, max(0.0, max(finite))) if finite else None


def parse_engine_metrics(text: str, at: float, engine: str | None = None) -> LoadSignals:
    """``LoadSignals`` from one scrape; ``engine`` ("vllm", "sglang", "llamacpp") or None to read
    whichever engine's names the text carries (the first of vLLM, SGLang, llama.cpp that has any).
    """
    samples = samples_by_name(text)
    if engine is not None:
        specs = [SPECS[engine]]
    else:
        specs = [s for s in SPECS.values() if any(n in samples for _, ns in s for n in ns)][:1]
    fields: dict[str, int | float | None] = {}
    for spec in specs:
        for field, names in spec:
            values = next((samples[n] for n in names if n in samples), None)
            if values is None:
                continue
            if field == "kv_usage":
                fields[field] = _fraction(values)
            elif field == "itl_seconds_total":
                fields[field] = _total(values)
            else:
                fields[field] = _count(values)
    kv = fields.get("kv_usage")
    adapters = loaded_adapters(text) if VLLM in specs and LORA_INFO in text else None
    return LoadSignals(
        at=at,
        running=_int(fields.get("running")),
        waiting=_int(fields.get("waiting")),
        kv_usage=float(kv) if kv is not None else None,
        preemptions_total=_int(fields.get("preemptions_total")),
        itl_seconds_total=_float(fields.get("itl_seconds_total")),
        itl_tokens_total=_int(fields.get("itl_tokens_total")),
        prompt_tokens_total=_int(fields.get("prompt_tokens_total")),
        output_tokens_total=_int(fields.get("output_tokens_total")),
        adapters=adapters.loaded if adapters is not None else None,
        adapter_capacity=adapters.capacity if adapters is not None else None,
    )


def _int(v: int | float | None) -> int | None:
    return None if v is None else int(v)


def _float(v: int | float | None) -> float | None:
    return None if v is None else float(v)
