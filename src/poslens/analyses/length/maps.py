"""The averaged attention maps at an evaluation length and their leakage metrics, with intervals.

`LengthMaps` is poslens's `Capture` (head-mean scores, log-probabilities with the log-partition, probabilities),
per group of sequences; the metrics are `poslens.analyses.leakage.metrics.leakage_metrics` of each layer's mean
maps on the default domain (offsets up to T / 2, each layer's own window), with delete-one-group jackknife
intervals over the same groups. Past `max_position_embeddings` the capture runs under
`checks.context_limit_lifted` (the model computes positions on the fly; refused where it does not).

Causality makes the map at length T the top-left T x T block of the map at any longer length (query i sees keys
j <= i only), so the maps of several lengths can come from one capture at the longest (`metrics(n=T)`), except
where the model or an intervention depends on the sequence's length (dynamic RoPE, an NTK factor T / L).
"""

from __future__ import annotations

import torch

from poslens.analyses.leakage.metrics import Domain, leakage_metrics, split, toeplitz_fraction
from poslens.analyses.length.checks import context_limit_lifted
from poslens.engine.capture import Capture
from poslens.engine.stats import DEFAULT_GROUPS, Estimate

KEYS = ("scores", "log_probs", "probs")
SPLIT = ("e_total", "e_logit", "e_partition", "cross", "share_logit", "share_partition", "share_cross", "fraction")
LEAN = ("scores/trf", "log_probs/trf", *(f"split/{k}" for k in SPLIT))  # no fit beyond diagonal means


def lean_metrics(maps: dict[str, torch.Tensor], domain: Domain) -> dict[str, torch.Tensor]:
    """The Toeplitz-residual fractions of the scores and log-probabilities and the split of the latter (the
    leakage terms), which need only diagonal means (no pseudo-inverse): `leakage_metrics`'s values for these names."""
    out = {f"{k}/trf": toeplitz_fraction(maps[k], domain) for k in ("scores", "log_probs") if k in maps}
    out.update({f"split/{k}": v for k, v in split(maps["scores"], maps["log_partition"], domain).items()})
    return out


class LengthMaps(Capture):
    """The capture (head-mean scores, log-probabilities with the log-partition, probabilities) at one model, run past
    max_position_embeddings where the model allows it, with the leakage metrics of its mean maps (`metrics`)."""

    name = "length_maps"

    def __init__(self, model, layers: list[int] | None = None, groups: int = DEFAULT_GROUPS,
                 probs: bool = True) -> None:
        super().__init__(model, layers, probs=probs, log_probs=True, groups=groups)

    def begin_batch(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                    group: int | None = None) -> None:
        with context_limit_lifted(self.model, input_ids.shape[1]):  # the guard reads the config here, only here
            super().begin_batch(input_ids, attention_mask, group)

    def update(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               group: int | None = None) -> None:
        """Capture one batch [B, T] into `group` (default: round robin), past max_position_embeddings if need be."""
        with context_limit_lifted(self.model, input_ids.shape[1]):
            super().update(input_ids, attention_mask, group)

    def metrics(self, level: float = 0.95, n: int | None = None, names: tuple[str, ...] | None = None
                ) -> dict[str, Estimate]:
        """Every leakage metric (or those in `names`) per captured layer ([layers] each), on the top-left n x n block
        of the maps (default: the whole length), with jackknife intervals."""
        size = self._n if n is None else n
        return self.metrics_at([size], level, names)[size]

    def metrics_at(self, lengths: list[int], level: float = 0.95, names: tuple[str, ...] | None = None
                   ) -> dict[int, dict[str, Estimate]]:
        """`metrics` at several lengths (top-left blocks), from one jackknife over the groups (each replicate's
        means are formed once for every length). Names in `LEAN` only: no fit beyond diagonal means."""
        gs = self.grouped()
        windows = [int(w) for w in self._window]
        layers = self.layers
        keys: list[str] = []

        def per_layer(m: dict[str, torch.Tensor]) -> torch.Tensor:
            out = []
            for size in lengths:
                cols = []
                for layer, w in zip(layers, windows):
                    maps = {k: m[f"{k}/{layer}"] for k in KEYS if f"{k}/{layer}" in m}
                    maps["log_partition"] = m[f"log_partition/{layer}"]
                    maps = {k: v[..., :size, :size] if v.dim() == 2 else v[:size] for k, v in maps.items()}
                    lean = names is not None and set(names) <= set(LEAN)
                    vals = (lean_metrics if lean else leakage_metrics)(maps, Domain(window=w or None))
                    if not keys:
                        keys.extend(sorted(vals) if names is None else [k for k in names if k in vals])
                    cols.append(torch.stack([vals[k].reshape(()) for k in keys]))
                out.append(torch.stack(cols, 1))  # [metrics, layers]
            return torch.stack(out)  # [lengths, metrics, layers]

        est = gs.estimate(per_layer, level)
        return {size: {k: Estimate(est.value[a, i], est.lo[a, i], est.hi[a, i], est.se[a, i], est.groups, est.level,
                                   est.method) for i, k in enumerate(keys)}
                for a, size in enumerate(lengths)}

    def result(self, level: float = 0.95, metrics: bool = True) -> dict[str, torch.Tensor]:
        """The capture's mean maps (with `_se`) and, with `metrics`, every metric as `metric/NAME` [layers] with
        `_lo`, `_hi`, `_se`."""
        out = super().result(level=level)
        for name, est in (self.metrics(level) if metrics else {}).items():
            out.update(est.as_dict(f"metric/{name}"))
        return out
