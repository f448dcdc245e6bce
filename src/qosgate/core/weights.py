"""Model weight: what a token of each model costs, in tokens of the reference model.

A token of a 70B model takes many times the accelerator time of a token of a 1B model. Charging
both the same would let a tenant on the heavy model take most of the fleet while fair share calls
it even. So every cost the core reckons (fair share's virtual counters, the tenants' cost
estimates at admission, the simulator's) is in one unit, the *reference token*: a token of the
reference model (``fairness.reference_model``, else the first model configured), weighted by the
fairness weights as before. A model's weight is how many reference tokens one of its tokens is
worth, separately for prompt (prefill) and output (decode) tokens, since the two scale apart.

A weight is configured, taken from engine profiles (resolved into numbers before the core sees
them), or learned (``weight: auto``) from what the engines spend: an engine that accounts its
time per model says each model's seconds per unit of reference cost (``time_per_unit``); else a
replica serving one model gives that model's time per output token (its inter-token latency over
the sequences that shared each step, from ``/metrics``). It is 1 until both the model and the
reference are measured. An adapter (``base``) costs what its base does unless given a weight of
its own; its ``load_cost`` is charged once per cold load.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from qosgate.config import ModelSpec

# how much each new measurement moves a learned time per token (an EWMA: it follows an engine
# that slows or speeds up over minutes, not one noisy scrape)
_LEARN_RATE = 0.2


@dataclass(frozen=True, slots=True)
class Weight:
    """One model's cost per token, in reference tokens, and where the figure comes from."""

    prompt: float = 1.0
    output: float = 1.0
    source: str = "reference"  # reference | configured | profile | learned | unmeasured


_REFERENCE = Weight()


class ModelWeights:
    """Each model's weight (``of``), an adapter's base and load cost, and the learning of the
    ``auto`` ones from measured times per token (``measured``)."""

    __slots__ = ("_auto", "_base", "_load", "_times", "_weights", "reference")

    def __init__(self, specs: Iterable[ModelSpec], reference: str | None = None) -> None:
        specs = tuple(specs)
        self.reference = reference if reference is not None else (
            specs[0].name if specs else "")
        self._base = {m.name: m.base for m in specs if m.base is not None}
        self._load = {m.name: m.load_cost for m in specs if m.load_cost}
        # each learned (auto) model, and its kinds given a number: (prompt, output), None
        # where learned
        self._auto = {m.name: (m.prompt_weight, m.output_weight) for m in specs
                      if m.weight == "auto"}
        self._weights: dict[str, Weight] = {}
        for m in specs:
            own = m.model_fields_set & {"weight", "prompt_weight", "output_weight"}
            if m.weight == "auto" or (m.base is not None and not own):
                continue  # learned, or an adapter that costs what its base does
            w = float(m.weight)
            prompt = m.prompt_weight if m.prompt_weight is not None else w
            output = m.output_weight if m.output_weight is not None else w
            if (prompt, output) != (1.0, 1.0) or m.name != self.reference:
                self._weights[m.name] = Weight(prompt, output, "configured")
        for name, (fp, fo) in self._auto.items():
            self._weights[name] = Weight(fp or 1.0, fo or 1.0, "unmeasured")
        # model -> (seconds per prompt token, seconds per output token), learned
        self._times: dict[str, tuple[float | None, float | None]] = {}

    @property
    def learning(self) -> bool:
        """Whether any weight is learned (``auto``): the engines' times are then worth
        reading."""
        return bool(self._auto)

    @property
    def weighted(self) -> bool:
        """Whether any model costs other than the reference (else the core may skip lookups)."""
        return bool(self._weights) or bool(self._base) or bool(self._load)

    def base_of(self, model: str) -> str:
        """The model whose weights ``model`` has: its base if it is an adapter, else itself."""
        return self._base.get(model, model)

    def of(self, model: str) -> Weight:
        """``model``'s weight: its own, else its base's if it is an adapter (an adapter given
        a weight of its own, for the compute its low-rank matrices add, has that); a model
        nobody configured costs what the reference does."""
        w = self._weights.get(model)
        if w is not None:
            return w
        return self._weights.get(self._base.get(model, model), _REFERENCE)

    def load_cost(self, model: str) -> float:
        """What loading adapter ``model`` cold costs, in reference tokens (0 for a model)."""
        return self._load.get(model, 0.0)

    def set_profiled(self, model: str, prompt: float, output: float) -> None:
        """Weights derived from engine profiles (the runtime resolves the files)."""
        self._weights[model] = Weight(prompt, output, "profile")

    def measured(self, model: str, prompt_s: float | None, output_s: float | None) -> None:
        """An engine serving ``model`` took ``prompt_s`` seconds per prompt token and
        ``output_s`` per output token of accelerator time lately (either None: not measured
        this time). Learns the ``auto`` weights against the reference's times."""
        old_p, old_o = self._times.get(model, (None, None))
        self._times[model] = (_ewma(old_p, prompt_s), _ewma(old_o, output_s))
        if model == self.reference:
            for name in self._auto:
                self._relearn(name)
        elif model in self._auto:
            self._relearn(model)

    def _relearn(self, model: str) -> None:
        ref_p, ref_o = self._times.get(self.reference, (None, None))
        p, o = self._times.get(model, (None, None))
        old = self._weights.get(model, Weight(1.0, 1.0, "unmeasured"))
        output = o / ref_o if o and ref_o else old.output
        # the engines export no accelerator time per prompt token that is comparable across
        # them (vLLM's prefill time counts the steps shared with decodes): a model measured on
        # its output alone is taken to scale its prefill alike (both are its work per token)
        prompt = p / ref_p if p and ref_p else (output if o and ref_o else old.prompt)
        learned = bool((p and ref_p) or (o and ref_o))
        fp, fo = self._auto.get(model, (None, None))
        self._weights[model] = Weight(fp or prompt, fo or output,
                                      "learned" if learned else "unmeasured")

    def view(self) -> dict[str, dict[str, float | str]]:
        """Every weighted model's weight and its source (for the status and the metrics)."""
        out: dict[str, dict[str, float | str]] = {}
        for name, w in sorted(self._weights.items()):
            out[name] = {"prompt": w.prompt, "output": w.output, "source": w.source}
        for name, base in sorted(self._base.items()):
            w = self.of(name)
            out[name] = {"prompt": w.prompt, "output": w.output, "source": f"base {base}",
                         "load_cost": self.load_cost(name)}
        return out


def _ewma(old: float | None, new: float | None) -> float | None:
    if new is None or new <= 0:
        return old
    if old is None:
        return new
    return old + _LEARN_RATE * (new - old)


def time_per_unit(before: Iterable[tuple[str, float, int, int]],
                  now: Iterable[tuple[str, float, int, int]], prompt_weight: float,
                  output_weight: float) -> list[tuple[str, float]]:
    """Per model, the engine seconds it took between two readings of an engine's per-model
    totals (model, seconds, prompt tokens, output tokens), over the cost of its tokens at the
    reference price; models with no tokens or no time between them are left out (an engine
    that restarted reads lower: nothing is learned from it)."""
    old = {m: (t, p, o) for m, t, p, o in before}
    out: list[tuple[str, float]] = []
    for model, t, p, o in now:
        t0, p0, o0 = old.get(model, (0.0, 0, 0))
        units = prompt_weight * (p - p0) + output_weight * (o - o0)
        if units > 0 and t > t0:
            out.append((model, (t - t0) / units))
    return out
