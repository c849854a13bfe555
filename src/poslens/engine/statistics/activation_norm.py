"""Mean L2 norm of a hook point's vectors at every position, per layer, with confidence intervals.

The reference example of a statistic (docs/architecture.md): it declares the points it reads, adds one sum per
(layer, group) from inside the forward, and finishes with the jackknife of `GroupedSums`. With the default point,
`blocks.{l}.hook_resid_pre`, row 0 is the norm of position 0's residual stream, which Ruscio et al. describe as a
closed dynamical system driven by the first token alone.
"""

from __future__ import annotations

import torch

from poslens.engine.stats import DEFAULT_GROUPS, Statistic
from poslens.errors import UsageError


class ActivationNorm(Statistic):
    """mean_sequences ||x_{l, i}|| for every layer l and position i of the hook point `point` (with `{l}`)."""

    name = "activation_norm"

    def __init__(self, point: str = "blocks.{l}.hook_resid_pre", layers: list[int] | None = None,
                 groups: int = DEFAULT_GROUPS) -> None:
        super().__init__(groups)
        if "{l}" not in point:
            raise UsageError(f"point must contain {{l}} for the layer, e.g. blocks.{{l}}.hook_resid_pre; got {point!r}")
        self.point, self.layers = point, layers
        self._valid: torch.Tensor | None = None

    def hooks(self, hm) -> dict:
        layers = range(hm.n_layers) if self.layers is None else self.layers
        return {self.point.format(l=l): self._read for l in layers}

    def begin_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Which tokens are real (padding never enters a mean)."""
        self._valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()

    def _read(self, x: torch.Tensor, ctx) -> None:
        valid = self._valid.to(x.device) if self._valid is not None else torch.ones(x.shape[:2], dtype=torch.bool)
        norms = torch.linalg.vector_norm(x.double(), dim=-1) * valid  # [B, T]
        self.sums.add(f"layer{ctx.layer}", self.group, norms.sum(0), valid.sum(0).double())

    def result(self, level: float = 0.95) -> dict[str, torch.Tensor]:
        """`norm` [layers, T] with `norm_lo`, `norm_hi`, `norm_se` (delete-a-group jackknife)."""
        names = sorted(self.sums.names(), key=lambda n: int(n[5:]))
        ests = [self.sums.estimate(lambda m, n=n: m[n], level=level) for n in names]
        out = {}
        for part in ("value", "lo", "hi", "se"):
            key = "norm" if part == "value" else f"norm_{part}"
            out[key] = torch.stack([getattr(e, part) for e in ests])
        out["layers"] = torch.tensor([int(n[5:]) for n in names])
        return out
