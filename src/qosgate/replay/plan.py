"""What to send and when: the simulator's workload (a scenario's draws, or a trace's rows) or a
JSONL of requests, turned into ``Planned`` requests -- each with its class, tenant key, exact
prompt and output lengths, and the instant (seconds after the start) it is due.

The simulator's ``Workload`` is the one source of arrivals, so a replay and ``qosgate simulate``
of the same scenario and seed send the very same requests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from qosgate.core import Classifier, QosInputError
from qosgate.core.prefix import Prefix
from qosgate.sim.scenarios import Prepared
from qosgate.sim.workload import Arrival, Stream, Workload, stream_inputs


@dataclass(slots=True, frozen=True)
class Planned:
    """One request of the replay (a first attempt; a retry is derived from it)."""

    rid: str
    t: float  # due, seconds after the replay's start
    stream: int
    service_class: str  # as the scenario's config classifies it (sent as ``x-qos-class``)
    tenant: str
    api_key: str | None  # sent as ``Authorization: Bearer``
    prompt: int  # prompt tokens
    output: int  # tokens asked for (``max_tokens``, with ``ignore_eos``)
    prefix: Prefix | None = None  # the trace's prompt blocks (Mooncake): shared blocks, shared text


def _classified(prep: Prepared, streams: tuple[Stream, ...]) -> list[tuple[str, str, str | None]]:
    """(class, tenant, key) of each stream, as the scenario's config classifies it."""
    classifier = Classifier(prep.cfg)
    out = []
    for st in streams:
        inputs = stream_inputs(st, prep.api_keys)
        try:
            c = classifier.classify(inputs)
        except QosInputError as exc:
            raise ValueError(f"stream {st.label()!r}: {exc.message}") from None
        out.append((c.service_class, c.tenant, inputs.api_key))
    return out


def plan_workload(prep: Prepared, wl: Workload) -> list[Planned]:
    """The workload's arrivals as requests; the output asked for is the workload's output
    length (what the simulated engine generates), so both runs generate the same tokens."""
    who = _classified(prep, wl.streams)

    def one(a: Arrival) -> Planned:
        cls, tenant, key = who[a.stream]
        return Planned(a.rid, a.t, a.stream, cls, tenant, key, a.prompt, a.output, a.prefix)

    return [one(a) for a in wl.arrivals]


def read_requests(path: Path, prep: Prepared) -> Workload:
    """A JSONL of requests as a workload, one object a line: ``t`` (seconds), ``prompt_tokens``,
    ``output_tokens``, and optionally ``class`` and ``tenant`` (a tenant of the scenario's
    config: its first key is sent) or ``api_key``. Each distinct (key, class) is a stream; the
    arrival span ends at the last ``t`` (or 1 s for a single request at 0)."""
    streams: dict[tuple[str | None, str | None], int] = {}
    rows: list[tuple[float, int, int, int]] = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                t = float(row["t"])
                prompt = int(row["prompt_tokens"])
                output = int(row["output_tokens"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: {exc!r} (need t, prompt_tokens, "
                                 "output_tokens)") from None
            if t < 0 or prompt < 1 or output < 1:
                raise ValueError(f"{path}:{n}: t >= 0 and lengths >= 1 are needed")
            key = row.get("api_key")
            if key is None and row.get("tenant") is not None:
                key = prep.api_keys.get(str(row["tenant"]))
                if key is None:
                    raise ValueError(f"{path}:{n}: tenant {row['tenant']!r} has no key in the "
                                     "scenario's config")
            cls = row.get("class")
            rows.append((t, streams.setdefault((key, cls), len(streams)), prompt, output))
    if not rows:
        raise ValueError(f"{path}: no requests")
    tenant_of = {k: name for name, k in prep.api_keys.items()}
    mix = tuple(
        Stream.model_validate({
            "share": 1, "name": "/".join(x for x in (tenant_of.get(k or ""), c) if x) or None,
            "api_key": k, "class": c})
        for (k, c) in streams
    )
    rows.sort()
    max_tokens = prep.scenario.max_tokens
    arrivals = tuple(Arrival(t, f"r{i:06d}", st, p, o, max(o, max_tokens))
                     for i, (t, st, p, o) in enumerate(rows))
    duration = max(rows[-1][0], 1.0)
    return Workload(arrivals, mix, tuple(stream_inputs(st, prep.api_keys) for st in mix),
                    duration, len(arrivals) / duration)
