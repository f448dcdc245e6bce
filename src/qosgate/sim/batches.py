"""Batch jobs as a simulator workload: N lines submitted at a time with a completion window, at a
class, for a tenant, beside the scenario's live traffic (``batches_feed.py`` feeds them).

A job is given in a scenario file (``jobs: [{lines: 20000, at_s: 0, window_s: 3600, class:
offline, tenant: acme}]``) or on the command line (``--job 20000@0s/1h,class=offline``: see
``parse_batch``). Its lines' lengths come from the job's own ``prompt``/``output`` laws, else from
the scenario's ``lengths`` -- for a trace scenario, whole rows of its trace drawn at random
(seeded), so a job "like today's requests" has today's prompt and output sizes, their correlation
kept. Each line is drawn once from ``"{seed}:job{k}"`` and replayed unchanged under every policy.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import ConfigDict, Field

from qosgate.config import Strict
from qosgate.core.batches_feed import RetryRule
from qosgate.core.classifier import QosInputs
from qosgate.settings import BatchSettings
from qosgate.sim.workload import LengthDist, Lengths, LengthSampler, Stream, TraceRow, _rng
from qosgate.wire.batches import completion_window_seconds


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``1h``, ``1.5d`` -> seconds: a completion window as the gateway
    reads one (``wire.batches.completion_window_seconds``), or a bare number of seconds."""
    text = text.strip()
    spec = text if text[-1:].isalpha() else text + "s"
    try:  # a start may be 0 (a window never is: completion_window_seconds refuses it)
        zero = spec[-1] in "smhd" and float(spec[:-1]) == 0
    except ValueError:
        zero = False
    seconds = 0.0 if zero else completion_window_seconds(spec)
    if seconds is None:
        raise ValueError(f"{text!r} is not a duration (a number and s, m, h or d, e.g. 1h)")
    return seconds


class BatchSpec(Strict):
    """One batch job of a scenario (see the module doc)."""

    lines: int = Field(ge=1, le=10_000_000, description="requests in the job's file")
    at_s: float = Field(default=0.0, ge=0, description="submitted this many virtual seconds in")
    window_s: float = Field(default=86_400.0, gt=0, description="completion window (24h: OpenAI's)")
    name: str | None = Field(default=None, description="label (default job1, job2, ...)")
    qos_class: str | None = Field(
        default=None, alias="class", description="the lines' class (default: batches' default)")
    tenant: str | None = Field(default=None, description="tenant (its first API key is used)")
    prompt: LengthDist | None = None
    output: LengthDist | None = None

    model_config = ConfigDict(populate_by_name=True)  # and Strict's


_KEYS = {"class": "class", "tenant": "tenant", "name": "name", "prompt": "prompt",
         "output": "output"}


def parse_batch(text: str) -> BatchSpec:
    """``LINES[@START][/WINDOW][,key=value...]``: ``20000@0s/1h,class=offline,tenant=acme``;
    ``prompt=N``/``output=N`` give every line that length (else the scenario's lengths). START
    defaults to 0, WINDOW to 24h."""
    head, *opts = [p.strip() for p in text.split(",")]
    m = re.match(r"^(\d+)(?:@([^/]+))?(?:/(.+))?$", head)
    if m is None:
        raise ValueError(f"--job {text!r}: give LINES, LINES@START or LINES@START/WINDOW, "
                         "e.g. 20000@0s/1h")
    raw: dict[str, Any] = {"lines": int(m.group(1))}
    if m.group(2):
        raw["at_s"] = parse_duration(m.group(2))
    if m.group(3):
        raw["window_s"] = parse_duration(m.group(3))
    for opt in opts:
        key, eq, val = opt.partition("=")
        if not eq or key.strip() not in _KEYS:
            raise ValueError(f"--job {text!r}: {opt!r} is not one of "
                             f"{', '.join(k + '=...' for k in _KEYS)}")
        key, val = key.strip(), val.strip()
        if key in ("prompt", "output"):
            if not val.isdigit() or int(val) < 1:
                raise ValueError(f"--job {text!r}: {key} takes a token count")
            raw[key] = {"dist": "constant", "value": int(val)}
        else:
            raw[_KEYS[key]] = val
    return BatchSpec.model_validate(raw)


@dataclass(slots=True, frozen=True)
class BatchPlan:
    """A job ready to run: its lines' (prompt, output) lengths and its QoS inputs."""

    name: str
    at: float
    completion_window_s: float  # the Batch API's completion_window
    qos_class: str  # the class its lines ask for (the tenant's allowed classes may clamp it)
    tenant: str | None
    inputs: QosInputs
    lines: tuple[tuple[int, int], ...]
    max_tokens: int  # what each line asks for at most (>= its output)

    @property
    def deadline(self) -> float:
        return self.at + self.completion_window_s


def plan_batches(
    jobs: Sequence[BatchSpec],
    lengths: Lengths,
    trace: Sequence[TraceRow] | None,
    api_keys: dict[str, str],
    seed: int,
    max_tokens: int,
    default_class: str,
) -> tuple[BatchPlan, ...]:
    """Draw every job's lines (seeded per job) and resolve its class and tenant key (its lines
    are classified as the gateway's are: at the job's class, without the tier's boost)."""
    out: list[BatchPlan] = []
    for k, job in enumerate(jobs):
        name = job.name or f"job{k + 1}"
        stream = Stream(share=1, prompt=job.prompt, output=job.output)
        sampler = LengthSampler([stream], lengths, trace, _rng(seed, f"job{k}"))
        lines = tuple(sampler.draw(0) for _ in range(job.lines))
        key = None
        if job.tenant is not None:
            if job.tenant not in api_keys:
                raise ValueError(f"job {name}: tenant {job.tenant!r} is not in the config or "
                                 "has no api_keys")
            key = api_keys[job.tenant]
        cls = job.qos_class or default_class
        out.append(BatchPlan(name, job.at_s, job.window_s, cls, job.tenant,
                           QosInputs(api_key=key, qos_class=cls, batch_line=True),
                           lines, max_tokens))
    return tuple(out)


def retry_rule(batches: BatchSettings) -> RetryRule:
    """The gateway's retry knobs (``settings.batches``) as the feed policy takes them."""
    return RetryRule(batches.retries, batches.backoff_s, batches.backoff_max_s)
