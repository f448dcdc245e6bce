"""The fit: measurements in, the step model's coefficients out (pure, no I/O).

The simulator's step time (``models/simmodel.py``) is linear in five coefficients::

    step_fixed_s + prefill_s_per_token * prefill tokens
                 + prefill_s_per_ctx_token * (prefill token, token it attends to) pairs
                 + decode_s_per_ctx_token * context tokens of the decoding seqs
                 + decode_s_per_seq * decoding seqs

so each measurement is a row of known counts times those coefficients. Two kinds are measured:

- ``ttft``: one request alone on an idle engine, ``max_tokens`` 1. Its prefill runs in
  ``ceil(L / max_num_batched_tokens)`` steps (vLLM's chunked prefill) holding L prompt tokens in
  all and ``L * (L + 1) / 2`` attention pairs whatever the chunks, no decode: row
  ``(steps, L, L * (L + 1) / 2, 0, 0)``, plus the client-visible overhead the engine model
  does not hold (HTTP, tokenization, detokenization): a fifth unknown ``overhead_s``, on TTFT
  rows only, fitted and reported but not part of the profile.
- ``tpot``: n requests decoding together; the mean gap between tokens while all n decode is one
  pure-decode step: row ``(1, 0, 0, sum of contexts, n)``.

Least squares on the *relative* error (each row divided by its measurement): a 200 ms prefill and
a 10 ms decode step count alike. A coefficient that comes out negative is pinned to 0 and the
rest refitted (an active set: the profile's fields are all >= 0); one the rows cannot tell apart
from the others (a singular column) is reported as not identified and left at 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

# the profile's coefficients, then the overhead on TTFT rows
PARAMS = (
    "step_fixed_s",
    "prefill_s_per_token",
    "prefill_s_per_ctx_token",
    "decode_s_per_ctx_token",
    "decode_s_per_seq",
    "overhead_s",
)
MIN_STEP_FIXED_S = 1e-6  # the profile needs step_fixed_s > 0 (time must advance)

Kind = Literal["ttft", "tpot"]


@dataclass(frozen=True, slots=True)
class Observation:
    """One measured time and the counts the step model multiplies (see the module doc)."""

    kind: Kind
    label: str
    measured_s: float
    steps: float = 0.0
    prefill_tokens: float = 0.0
    prefill_pairs: float = 0.0
    ctx_tokens: float = 0.0
    seqs: float = 0.0

    def row(self) -> tuple[float, ...]:
        return (
            self.steps,
            self.prefill_tokens,
            self.prefill_pairs,
            self.ctx_tokens,
            self.seqs,
            1.0 if self.kind == "ttft" else 0.0,
        )


def ttft_observation(label: str, measured_s: float, prompt_tokens: int,
                     max_num_batched_tokens: int) -> Observation:
    """A lone request's time to first token: its prefill's chunks, each a step."""
    steps = math.ceil(prompt_tokens / max_num_batched_tokens)
    return Observation("ttft", label, measured_s, steps=steps, prefill_tokens=prompt_tokens,
                       prefill_pairs=prompt_tokens * (prompt_tokens + 1) / 2)


def tpot_observation(label: str, measured_s: float, ctx_tokens: float,
                     seqs: int) -> Observation:
    """The mean gap between tokens of ``seqs`` requests all decoding (one step each)."""
    return Observation("tpot", label, measured_s, steps=1, ctx_tokens=ctx_tokens, seqs=seqs)


@dataclass(frozen=True, slots=True)
class Fit:
    """The coefficients (``PARAMS`` order), those that could not be identified, and the rows."""

    coef: dict[str, float]
    unidentified: tuple[str, ...]
    observations: tuple[Observation, ...] = field(default=())

    def modelled(self, obs: Observation) -> float:
        return sum(c * self.coef[p] for c, p in zip(obs.row(), PARAMS, strict=True))

    def errors(self) -> list[float]:
        """Relative error per observation: (modelled - measured) / measured."""
        return [(self.modelled(o) - o.measured_s) / o.measured_s for o in self.observations]


def fit(observations: Sequence[Observation]) -> Fit:
    """Weighted least squares (relative error), coefficients >= 0; see the module doc."""
    obs = [o for o in observations if o.measured_s > 0]
    if not obs:
        raise ValueError("no measurement to fit")
    rows = [[c / o.measured_s for c in o.row()] for o in obs]
    target = [1.0] * len(obs)
    active = [j for j in range(len(PARAMS)) if any(r[j] for r in rows)]
    unidentified: set[int] = set(range(len(PARAMS))) - set(active)
    while True:
        sol, singular = _solve(rows, target, active)
        if singular:
            unidentified |= set(singular)
            active = [j for j in active if j not in singular]
            continue
        negative = [j for j in active if sol[j] < 0]
        if not negative:
            break
        worst = min(negative, key=lambda j: sol[j])
        active.remove(worst)  # pinned to 0, the rest refitted
    coef = {p: max(sol.get(j, 0.0), 0.0) for j, p in enumerate(PARAMS)}
    coef["step_fixed_s"] = max(coef["step_fixed_s"], MIN_STEP_FIXED_S)
    return Fit(coef, tuple(PARAMS[j] for j in sorted(unidentified)), tuple(obs))


def _solve(rows: list[list[float]], target: list[float],
           cols: list[int]) -> tuple[dict[int, float], list[int]]:
    """Least squares over ``cols`` by the normal equations (columns scaled to unit norm, then
    Gaussian elimination with partial pivoting): the solution, or the columns found singular."""
    if not cols:
        return {}, []
    norms = [math.sqrt(sum(r[j] ** 2 for r in rows)) or 1.0 for j in cols]
    k = len(cols)
    a = [[sum(r[cols[i]] * r[cols[j]] for r in rows) / (norms[i] * norms[j])
          for j in range(k)] + [sum(r[cols[i]] * t for r, t in zip(rows, target, strict=True))
                                / norms[i]] for i in range(k)]
    for c in range(k):
        p = max(range(c, k), key=lambda i: abs(a[i][c]))
        if abs(a[p][c]) < 1e-10:  # this column is a combination of the ones before it
            return {}, [cols[c]]
        a[c], a[p] = a[p], a[c]
        for i in range(k):
            if i != c and a[i][c]:
                f = a[i][c] / a[c][c]
                for j in range(c, k + 1):
                    a[i][j] -= f * a[c][j]
    # rows were swapped, never columns: row c now solves column c
    return {cols[c]: a[c][k] / a[c][c] / norms[c] for c in range(k)}, []
