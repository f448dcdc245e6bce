"""What a request costs, in the fair-share units the queues charge and the tenants' limits count.

Its cost is ``prompt_weight`` per prompt token plus ``output_weight`` per output token
(``fairness`` in the config), each times its model's weight (``core.weights``): the unit is a
token of the reference model. At admission the output is not known yet: it is estimated as its
class's learned mean output length within the request's cap, and the real usage is settled when
the request ends (a request that never started is charged no prompt). The cap itself comes from
the client, the configured ceilings of its class and tenant, or the engine's context.
"""

from __future__ import annotations

from qosgate.config import QosConfig, ServiceClass
from qosgate.core.weights import ModelWeights


class Pricing:
    __slots__ = ("_ceilings", "_classes", "_max_output", "_out_est", "_tenant_caps",
                 "output_weight", "prompt_weight", "weights")

    def __init__(self, cfg: QosConfig, classes: list[ServiceClass]) -> None:
        self.prompt_weight = cfg.fairness.prompt_weight
        self.output_weight = cfg.fairness.output_weight
        # the models' weights: a reload leaves them (``models`` needs a restart), so what was
        # learned or taken from profiles stays
        self.weights = ModelWeights(cfg.models, cfg.fairness.reference_model)
        self._max_output = cfg.admission.max_output_tokens
        self._out_est = [256.0] * len(classes)  # each class's learned mean output length
        self._classes = classes  # the scheduler's own list: shared, not copied
        self.retenant(cfg)

    def retenant(self, cfg: QosConfig) -> None:
        """The tenants' output ceilings of ``cfg`` (at start, and on a reload)."""
        self._tenant_caps = {t.name: t.limits.max_output_tokens for t in cfg.tenants}
        # (level, tenant) -> its ceiling (``_ceiling``)
        self._ceilings: dict[tuple[int, str], int | None] = {}

    def price(self, level: int, tenant: str, max_tokens: int | None, prompt_tokens: int,
              context: int | None, model: str = "") -> tuple[int, int | None, float, float]:
        """A new request's (output cap, configured ceiling, estimated output, cost), in one call
        (one per request).

        ``max_tokens`` is what the client asked for; None: none, so the engine runs to its own
        end, within its ``context`` (prompt and output, as the engine reports it) unless a
        configured ceiling applies. The output charged is the class's learned mean within the
        cap."""
        try:
            ceiling = self._ceilings[(level, tenant)]
        except KeyError:
            ceiling = self._ceiling(level, tenant)
        if max_tokens is None:
            most = self._max_output
            if ceiling is not None:
                max_tokens = ceiling
            elif context is not None:
                max_tokens = max(1, min(context - prompt_tokens, most))
            else:
                max_tokens = most
        cap, learned = float(max_tokens), self._out_est[level]
        est = learned if learned < cap else cap  # (min(cap, learned), without the builtin call)
        if model and self.weights.weighted:
            w = self.weights.of(model)
            return (max_tokens, ceiling, est, self.prompt_weight * w.prompt * prompt_tokens
                    + self.output_weight * w.output * est)
        return (max_tokens, ceiling, est,
                self.prompt_weight * prompt_tokens + self.output_weight * est)

    def _ceiling(self, level: int, tenant: str) -> int | None:
        """The smaller of the class's and the tenant's configured output ceilings (remembered:
        the config does not change, and a request's tenant is a configured one or the default,
        so there are few)."""
        caps = [self._classes[level].max_output_tokens]
        if tenant in self._tenant_caps:
            caps.append(self._tenant_caps[tenant])
        ceiling = self._ceilings[(level, tenant)] = min(
            (v for v in caps if v is not None), default=None)
        return ceiling

    def used(self, prompt_tokens: int, output_tokens: int, started: bool,
             model: str = "") -> float:
        """The cost a request actually used (one that never started used no prompt)."""
        if model and self.weights.weighted:
            w = self.weights.of(model)
            return ((self.prompt_weight * w.prompt * prompt_tokens if started else 0.0)
                    + self.output_weight * w.output * output_tokens)
        return ((self.prompt_weight * prompt_tokens if started else 0.0)
                + self.output_weight * output_tokens)

    def prompt_cost(self, tokens: int, model: str = "") -> float:
        """What ``tokens`` prompt tokens of ``model`` cost (a cached part's credit)."""
        if model and self.weights.weighted:
            return self.prompt_weight * self.weights.of(model).prompt * tokens
        return self.prompt_weight * tokens

    def learn(self, level: int, output_tokens: int) -> None:
        """A request of class ``level`` completed with ``output_tokens``."""
        est = self._out_est
        est[level] += 0.05 * (output_tokens - est[level])
