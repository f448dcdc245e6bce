"""Workloads for the simulator: arrival times, token lengths, and who asks for what.

A workload is a list of ``Arrival``s, built once from a seed and replayed unchanged under every
policy, so policies are compared on exactly the same requests.

- Trace files: the Azure LLM CSV (``TIMESTAMP``, ``ContextTokens``, ``GeneratedTokens``) or the
  Mooncake JSONL (``mooncake.py``: lengths and the prompt's block ids), told apart by extension or
  content. A Mooncake row's block ids go with its request, replayed, as its ``Prefix``.
- Arrivals: ``poisson`` (exponential gaps at ``rate``), ``gamma`` (gamma gaps with shape
  ``burstiness``, mean ``1/rate``: the convention of vLLM's ``benchmark_serving.py`` — 1 is Poisson,
  below 1 is burstier, above 1 smoother) or ``trace`` (the timestamps of a trace file, divided by a
  ``time_scale``: 2 replays the trace twice as fast, i.e. at twice its load).
- Lengths: ``constant``, ``uniform``, ``exponential``, ``lognormal`` (by mean and coefficient of
  variation) or ``trace`` (prompt and output drawn *together* from one trace row, so their
  correlation is kept); a trace replay takes each row's own lengths.
- Who: a ``mix`` of streams, each with a share, a tenant and the request's QoS inputs (class,
  priority, task type or latency budget); every request draws its stream with the shares as weights.

Every random draw comes from ``random.Random`` streams seeded with ``"{seed}:{purpose}"`` strings
(seeded through SHA-512, independent of ``PYTHONHASHSEED``), so one seed gives one workload on any
machine.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from qosgate.config import Strict
from qosgate.core.classifier import QosInputs
from qosgate.core.prefix import Prefix
from qosgate.sim.mooncake import looks_like_jsonl, parse_lines

TRACE_NAME = "azure_llm_conv_2023.csv"
TRACE_ATTRIBUTION = (
    "Azure LLM inference trace 2023 (conversation), Azure/AzurePublicDataset, CC-BY 4.0; "
    'Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", '
    "ISCA 2024."
)
MOONCAKE_TRACE_NAME = "mooncake_conversation_trace.jsonl"
MOONCAKE_ATTRIBUTION = (
    "Mooncake conversation trace, kvcache-ai/Mooncake, Apache-2.0; Qin et al., \"Mooncake: "
    "Trading More Storage for Less Computation - A KVCache-centric Architecture for Serving LLM "
    'Chatbot", FAST 2025.'
)
# the traces whose source qosgate knows, by file name (those in shared/traces/)
KNOWN_TRACES: dict[str, str] = {
    TRACE_NAME: TRACE_ATTRIBUTION,
    MOONCAKE_TRACE_NAME: MOONCAKE_ATTRIBUTION,
}


def trace_attribution(path: str | Path) -> str:
    """Whom the request data read from ``path`` comes from: a known trace's source and license,
    else the file's name and a plain statement that its source is not known here."""
    name = Path(path).name
    known = KNOWN_TRACES.get(name)
    if known is not None:
        return known
    return f"{name} (a trace given with --trace; its source and license are not known to qosgate)"


# ------------------------------------------------------------------------------ length laws
class Constant(Strict):
    dist: Literal["constant"]
    value: int = Field(ge=1)


class Uniform(Strict):
    dist: Literal["uniform"]
    low: int = Field(ge=1)
    high: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> Uniform:
        if self.high < self.low:
            raise ValueError("uniform: high must be >= low")
        return self


class Exponential(Strict):
    dist: Literal["exponential"]
    mean: float = Field(gt=0)
    min: int = Field(default=1, ge=1)
    max: int = Field(default=1 << 20, ge=1)


class LogNormal(Strict):
    """Log-normal with the given mean and coefficient of variation (std/mean), clamped."""

    dist: Literal["lognormal"]
    mean: float = Field(gt=0)
    cv: float = Field(default=1.0, gt=0)
    min: int = Field(default=1, ge=1)
    max: int = Field(default=1 << 20, ge=1)


class FromTrace(Strict):
    """Drawn from the rows of the scenario's trace (prompt and output from the same row)."""

    dist: Literal["trace"]


LengthDist = Annotated[
    Constant | Uniform | Exponential | LogNormal | FromTrace, Field(discriminator="dist")
]


def draw_length(d: Constant | Uniform | Exponential | LogNormal, rng: random.Random) -> int:
    if isinstance(d, Constant):
        return d.value
    if isinstance(d, Uniform):
        return rng.randint(d.low, d.high)
    if isinstance(d, Exponential):
        x = rng.expovariate(1.0 / d.mean)
    else:
        sigma2 = math.log1p(d.cv * d.cv)
        x = rng.lognormvariate(math.log(d.mean) - sigma2 / 2.0, math.sqrt(sigma2))
    return min(d.max, max(d.min, round(x)))


# ------------------------------------------------------------------------------ streams
class Stream(Strict):
    """One kind of traffic in the mix: who sends it, with which QoS inputs, how long it is."""

    share: float = Field(gt=0, description="relative weight of this stream among arrivals")
    name: str | None = Field(default=None, description="label (defaults to tenant/class)")
    tenant: str | None = Field(default=None, description="tenant name (its first API key is used)")
    api_key: str | None = None
    qos_class: str | None = Field(default=None, alias="class")
    priority: int | None = None
    task_type: str | None = None
    latency_budget_ms: float | None = Field(default=None, gt=0)
    model: str | None = Field(default=None, description="the model it asks for (the "
                              "scenario's models); unset: any replica serves it")
    prompt: LengthDist | None = None
    output: LengthDist | None = None

    model_config = ConfigDict(populate_by_name=True)  # and Strict's

    def label(self) -> str:
        if self.name:
            return self.name
        parts = [
            p
            for p in (
                self.tenant,
                self.qos_class,
                self.task_type,
                None if self.priority is None else f"p{self.priority}",
            )
            if p
        ]
        return "/".join(parts) or "default"


class Lengths(Strict):
    prompt: LengthDist = LogNormal(dist="lognormal", mean=1000, cv=1.0, max=8192)
    output: LengthDist = LogNormal(dist="lognormal", mean=200, cv=1.0, max=2048)


# ------------------------------------------------------------------------------ trace
@dataclass(slots=True, frozen=True)
class TraceRow:
    t: float  # seconds since the first row
    prompt: int
    output: int
    prefix: Prefix | None = None  # the prompt's block keys, where the trace has them


def _seconds(stamp: str, day0: int) -> float:
    """'2023-11-16 18:15:46.6805900' -> seconds since midnight of ordinal ``day0``."""
    day, _, clock = stamp.strip().partition(" ")
    hh, mm, ss = clock.split(":")
    days = date.fromisoformat(day).toordinal() - day0
    return days * 86400.0 + int(hh) * 3600.0 + int(mm) * 60.0 + float(ss)


_TRACE_CACHE: dict[Path, tuple[TraceRow, ...]] = {}


def read_trace(path: str | Path) -> tuple[TraceRow, ...]:
    """Rows of an Azure-LLM-style CSV (TIMESTAMP, ContextTokens, GeneratedTokens) or of a
    Mooncake JSONL (``mooncake.py``), sorted by time, times relative to the first row. Rows with
    a zero length are kept with a length of 1."""
    p = Path(path).resolve()
    cached = _TRACE_CACHE.get(p)
    if cached is not None:
        return cached
    if looks_like_jsonl(p):
        with p.open(encoding="utf-8") as f:
            moon = parse_lines(f, str(p))
        if not moon:
            raise ValueError(f"{p}: the trace has no rows")
        moon.sort(key=lambda r: r[0])
        t_first = moon[0][0]
        result = tuple(TraceRow(t - t_first, pr, out, pf) for t, pr, out, pf in moon)
        _TRACE_CACHE[p] = result
        return result
    rows: list[TraceRow] = []
    with p.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        need = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"}
        if reader.fieldnames is None or not need <= set(reader.fieldnames):
            raise ValueError(f"{p}: expected columns {sorted(need)}, got {reader.fieldnames}")
        day0: int | None = None
        raw: list[tuple[float, int, int]] = []
        for rec in reader:
            stamp = rec["TIMESTAMP"]
            if day0 is None:
                day0 = date.fromisoformat(stamp.strip().partition(" ")[0]).toordinal()
            raw.append(
                (
                    _seconds(stamp, day0),
                    max(1, int(rec["ContextTokens"])),
                    max(1, int(rec["GeneratedTokens"])),
                )
            )
    if not raw:
        raise ValueError(f"{p}: the trace has no rows")
    raw.sort(key=lambda r: r[0])
    t0 = raw[0][0]
    rows = [TraceRow(t - t0, pr, out) for t, pr, out in raw]
    result = tuple(rows)
    _TRACE_CACHE[p] = result
    return result


def find_trace(name: str = TRACE_NAME, start: Path | None = None) -> Path:
    """Find ``shared/traces/<name>``: walk up from this package (and from ``start`` / the working
    directory) looking for a ``shared/traces`` directory beside one of the ancestors."""
    p = Path(name)
    if p.is_file():
        return p
    origins = [Path(__file__).resolve()]
    origins.append((start or Path.cwd()).resolve())
    seen: set[Path] = set()
    for origin in origins:
        for d in [origin, *origin.parents]:
            if d in seen:
                continue
            seen.add(d)
            cand = d / "shared" / "traces" / p.name
            if cand.is_file():
                return cand
    raise FileNotFoundError(
        f"trace {name!r} not found: pass --trace PATH (looked for shared/traces/{p.name} "
        "beside the repository's ancestors)"
    )


# ------------------------------------------------------------------------------ arrivals
@dataclass(slots=True, frozen=True)
class Arrival:
    t: float
    rid: str
    stream: int
    prompt: int
    output: int  # tokens the simulated engine will generate (the workload's truth)
    max_tokens: int  # what the client asks for (>= output)
    prefix: Prefix | None = None  # the prompt's block keys (a trace replay that has them)


@dataclass(slots=True, frozen=True)
class Workload:
    arrivals: tuple[Arrival, ...]
    streams: tuple[Stream, ...]
    inputs: tuple[QosInputs, ...]  # per stream
    duration: float  # the arrival span [0, duration)
    rate: float  # offered requests per second (mean)

    @property
    def offered_rps(self) -> float:
        return len(self.arrivals) / self.duration if self.duration > 0 else 0.0


def _rng(seed: int, purpose: str) -> random.Random:
    return random.Random(f"{seed}:{purpose}")


def _gaps(process: str, rate: float, burstiness: float, rng: random.Random) -> float:
    if process == "poisson":
        return rng.expovariate(rate)
    shape = burstiness
    return rng.gammavariate(shape, 1.0 / (rate * shape))


class LengthSampler:
    """Draws (prompt, output) for a stream; ``trace`` laws take both from one trace row."""

    def __init__(
        self,
        streams: Sequence[Stream],
        defaults: Lengths,
        trace: Sequence[TraceRow] | None,
        rng: random.Random,
    ) -> None:
        self._laws = [(s.prompt or defaults.prompt, s.output or defaults.output) for s in streams]
        self._trace = trace
        self._rng = rng
        for p, o in self._laws:
            if (isinstance(p, FromTrace) or isinstance(o, FromTrace)) and not trace:
                raise ValueError("a 'trace' length law needs a trace file")

    def draw(self, stream: int, row: TraceRow | None = None) -> tuple[int, int]:
        p_law, o_law = self._laws[stream]
        rng = self._rng
        if row is None and (isinstance(p_law, FromTrace) or isinstance(o_law, FromTrace)):
            assert self._trace is not None
            row = self._trace[rng.randrange(len(self._trace))]
        prompt = row.prompt if isinstance(p_law, FromTrace) and row else 0
        output = row.output if isinstance(o_law, FromTrace) and row else 0
        if not isinstance(p_law, FromTrace):
            prompt = draw_length(p_law, rng)
        if not isinstance(o_law, FromTrace):
            output = draw_length(o_law, rng)
        return prompt, output


def stream_inputs(stream: Stream, api_keys: dict[str, str]) -> QosInputs:
    key = stream.api_key
    if key is None and stream.tenant is not None:
        if stream.tenant not in api_keys:
            raise ValueError(
                f"stream {stream.label()!r}: tenant {stream.tenant!r} is not in the config "
                "or has no api_keys"
            )
        key = api_keys[stream.tenant]
    return QosInputs(
        api_key=key,
        qos_class=stream.qos_class,
        priority=stream.priority,
        task_type=stream.task_type,
        latency_budget_ms=stream.latency_budget_ms,
    )


def build_workload(
    *,
    process: Literal["poisson", "gamma", "trace"],
    streams: Sequence[Stream],
    lengths: Lengths,
    api_keys: dict[str, str],
    seed: int,
    duration: float | None,
    rate: float | None = None,
    burstiness: float = 1.0,
    trace: Sequence[TraceRow] | None = None,
    time_scale: float = 1.0,
    max_tokens: int = 2048,
    use_trace_lengths: bool = True,
) -> Workload:
    """Draw the arrivals of one run. ``duration`` bounds the arrival span (None: the whole
    trace). For ``trace``, each row's own lengths are used (``use_trace_lengths``) unless its
    stream sets a length law of its own."""
    if not streams:
        raise ValueError("the workload mix has no streams")
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    shares = list(itertools.accumulate(s.share for s in streams))
    total_share = shares[-1]
    mix_rng = _rng(seed, "mix")
    len_rng = _rng(seed, "lengths")
    sampler = LengthSampler(streams, lengths, trace, len_rng)
    inputs = tuple(stream_inputs(s, api_keys) for s in streams)
    arrivals: list[Arrival] = []

    def pick() -> int:
        return bisect.bisect_right(shares, mix_rng.random() * total_share)

    def add(
        t: float, stream_i: int, prompt: int, output: int, prefix: Prefix | None = None
    ) -> None:
        i = len(arrivals)
        arrivals.append(
            Arrival(t, f"r{i:06d}", stream_i, prompt, output, max(output, max_tokens), prefix)
        )

    if process == "trace":
        if not trace:
            raise ValueError("a trace arrival process needs a trace file")
        horizon = math.inf if duration is None else duration
        for row in trace:
            t = row.t / time_scale
            if t >= horizon:
                break
            stream_i = min(pick(), len(streams) - 1)
            s = streams[stream_i]
            own = use_trace_lengths and s.prompt is None and s.output is None
            prompt, output = (row.prompt, row.output) if own else sampler.draw(stream_i, row)
            # the block ids stand for the recorded prompt: only a replay of its own length
            add(t, stream_i, prompt, output, row.prefix if prompt == row.prompt else None)
        span = trace[-1].t / time_scale if duration is None else duration
        dur = max(span, arrivals[-1].t if arrivals else 0.0) if duration is None else duration
        mean_rate = len(arrivals) / dur if dur > 0 else 0.0
        return Workload(tuple(arrivals), tuple(streams), inputs, dur, mean_rate)

    if rate is None or rate <= 0:
        raise ValueError(f"{process} arrivals need a rate > 0")
    if duration is None or duration <= 0:
        raise ValueError(f"{process} arrivals need a duration > 0")
    if burstiness <= 0:
        raise ValueError("burstiness must be > 0")
    arr_rng = _rng(seed, "arrivals")
    t = 0.0
    while True:
        t += _gaps(process, rate, burstiness, arr_rng)
        if t >= duration:
            break
        stream_i = min(pick(), len(streams) - 1)
        prompt, output = sampler.draw(stream_i)
        add(t, stream_i, prompt, output)
    return Workload(tuple(arrivals), tuple(streams), inputs, duration, rate)


def sample_lengths(
    streams: Sequence[Stream],
    lengths: Lengths,
    trace: Sequence[TraceRow] | None,
    seed: int,
    n: int,
) -> list[tuple[int, int]]:
    """``n`` (prompt, output) pairs drawn as the mix would draw them (for capacity estimates)."""
    shares = list(itertools.accumulate(s.share for s in streams))
    rng = _rng(seed, "capacity-mix")
    sampler = LengthSampler(streams, lengths, trace, _rng(seed, "capacity-lengths"))
    out = []
    for _ in range(n):
        i = min(bisect.bisect_right(shares, rng.random() * shares[-1]), len(streams) - 1)
        out.append(sampler.draw(i))
    return out
