"""Mean L2 norm of a hook point's vectors at every position, per layer, with confidence intervals.

The reference example of a statistic (docs/architecture.md): it declares the points it reads, adds one sum per
(layer, group) from inside the forward, and finishes with the jackknife of `GroupedSums`. With the default point,
`blocks.{l}.hook_resid_pre`, row 0 is the norm of position 0's residual stream, which Ruscio, Nanni & Silvestri
(2026, "Where does Absolute Position come from in decoder-only Transformers?") describe as a closed dynamical
system driven by the first token alone. Any point laid out [batch, pos, ...] works (docs/hooks.md); at per-head
points ([batch, pos, heads, d_head], e.g. attn.hook_z) the vector of a position is all its heads side by side.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poslens.engine.statistics.spec import Spec
from poslens.engine.stats import DEFAULT_GROUPS, Statistic
from poslens.errors import UsageError, check_int
from poslens.options import option


class ActivationNorm(Statistic):
    """mean_sequences ||x_{l, i}|| for every layer l and position i of the hook point `point` (with `{l}`)."""

    name = "activation_norm"

    def __init__(self, point: str = "blocks.{l}.hook_resid_pre", layers: list[int] | None = None,
                 groups: int = DEFAULT_GROUPS) -> None:
        super().__init__(groups)
        if "{l}" not in point:
            raise UsageError(f"point must contain {{l}} for the layer, e.g. blocks.{{l}}.hook_resid_pre; got {point!r}")
        if point.endswith(("hook_attn_scores", "hook_pattern")) or "_norm." in point:
            raise UsageError(f"point {point!r} is not laid out [batch, pos, ...] (attention maps are [batch, head, "
                             "query, key]; q/k norm points flatten batch, pos and heads); choose a point of "
                             "docs/hooks.md with pos second")
        self.point, self.layers = point, layers
        self._valid: torch.Tensor | None = None

    def hooks(self, hm) -> dict:
        layers = range(hm.n_layers) if self.layers is None else self.layers
        return {self.point.format(l=l): self._read for l in layers}

    def check_model(self, hm) -> None:
        """Every layer exists and its point on the model: else one line naming `layers` or `point`, before any
        sequence is cut."""
        for layer in self.layers or []:
            check_int("layers", layer, 0, hm.n_layers - 1)
        for name in self.hooks(hm):
            try:
                hm.check_point(name)
            except UsageError as e:
                raise UsageError(f"point {self.point!r}: {str(e).removeprefix('hooks: ')}", param="point") from None

    def begin_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> None:
        """Which tokens are real (padding never enters a mean)."""
        self._valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()

    def _read(self, x: torch.Tensor, ctx) -> None:  # x [B, T, ...]
        valid = self._valid.to(x.device) if self._valid is not None else torch.ones(x.shape[:2], dtype=torch.bool)
        norms = torch.linalg.vector_norm(x.double().flatten(2), dim=-1) * valid  # [B, T]
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


@dataclass
class ActivationNormOptions:
    """`poslens stat activation_norm`: which point, which layers."""

    point: str = option("blocks.{l}.hook_resid_pre", help="hook point with {l} for the layer index")
    layers: list[int] | None = option(None, help="comma-separated layer indices (default all)")


SPEC = Spec("activation_norm", "mean L2 norm of a hook point's vectors at every position, per layer",
            ActivationNormOptions, lambda hm, o, groups: ActivationNorm(o.point, o.layers, groups))
