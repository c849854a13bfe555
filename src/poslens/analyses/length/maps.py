"""The averaged attention maps at an evaluation length and their leakage metrics, with intervals.

`LengthMaps` is poslens's `Capture` (head-mean scores, log-probabilities with the log-partition, probabilities),
per group of sequences, plus what the gauge-invariant decomposition of `poslens leakage` needs and the head means
lose: per sequence and head, the log-partition L0 of the lag profile of the two-way fit s_ij = a_i + r(i - j) + e_ij
(`causal.lag_profile`, `causal.lag_partition`), averaged over sequences and heads. The metrics are
`poslens.analyses.leakage.metrics.leakage_metrics` of each layer's mean maps on the default domain (offsets up to
T / 2, each layer's own window), with delete-one-group jackknife intervals over the same groups; the length
section's set (`metrics.LEAN`: the TRFs, `scores/energy` and the decomposition `attn/...`) needs diagonal means only.
Past `max_position_embeddings` the capture runs under `checks.context_limit_lifted` (the model computes positions on
the fly; refused where it does not).

Causality makes the map at length T the top-left T x T block of the map at any longer length (query i sees keys
j <= i only), so the maps of several lengths come from one capture at the longest (`metrics(n=T)`), except where
the model or an intervention depends on the sequence's length (dynamic RoPE, an NTK factor T / L). The lag fit does
not have that property (the fit at T uses lag d's T - d entries; at a longer length more): it is computed in the
same forward for every length in `lengths`, from the row and diagonal sums of the top-left blocks of each block of
per-head scores the capture forms anyway (`Capture._block`), one [D, D] solve per length and window.
"""

from __future__ import annotations

import torch

from poslens.analyses.leakage.causal import SUPPORT, lag_partition, lag_profile
from poslens.analyses.leakage.metrics import LEAN, Domain, leakage_metrics, lean_metrics
from poslens.analyses.length.checks import context_limit_lifted
from poslens.engine.capture import Capture
from poslens.engine.stats import DEFAULT_GROUPS, Estimate, GroupedSums
from poslens.errors import UsageError, check_int

KEYS = ("scores", "log_probs", "probs")
LAG = "lag_log_partition"  # sums named f"{LAG}@{T}/{layer}" [T]: L0 of the fit at length T, over sequences x heads


def _stacked(means: dict[str, torch.Tensor], key: str, layers: list[int], size: int, dims: int) -> torch.Tensor:
    """The means `key/LAYER` of `layers` stacked, [layers, ...], cut to their top-left `size` entries in their last
    `dims` dimensions."""
    x = torch.stack([means[f"{key}/{layer}"] for layer in layers])
    return x[..., :size, :size] if dims == 2 else x[..., :size]


class LengthMaps(Capture):
    """The capture (head-mean scores, log-probabilities with the log-partition, probabilities) at one model, run past
    max_position_embeddings where the model allows it, with the leakage metrics of its mean maps (`metrics`).
    `lengths`: the evaluation lengths (top-left blocks) whose lag fit the decomposition needs (default: each
    batch's own length); the metrics are available at these lengths only."""

    name = "length_maps"

    def __init__(self, model, layers: list[int] | None = None, groups: int = DEFAULT_GROUPS,
                 probs: bool = True, lengths: list[int] | None = None) -> None:
        super().__init__(model, layers, probs=probs, log_probs=True, groups=groups)
        self.lengths = None if lengths is None else sorted({check_int("lengths", t, 2) for t in lengths})
        self.lags = GroupedSums(self.groups)  # the lag log-partitions: f"{LAG}@{T}/{layer}" [T] per group
        self._fit: dict = {}  # the layer being read: row sums and, per length, diagonal sums per sequence and head

    def _fit_lengths(self, n: int) -> list[int]:
        """The lengths whose lag fit a batch of n tokens gives: `lengths` up to n (default: n itself)."""
        return [n] if self.lengths is None else [t for t in self.lengths if t <= n]

    def _observe(self, x, ctx) -> None:
        """The capture's reader, and the lag fit of this layer's per-head scores at each length (`_block` adds the
        sums as the chunked path forms the blocks)."""
        if not self._batch.full:
            raise UsageError("the length maps' lag fit needs unpadded sequences of one length (no attention mask)")
        b, h, n, _ = ctx.rot_q.shape
        window = int(ctx.window or 0)
        lens = self._fit_lengths(n)
        self._fit = {"rows": torch.zeros(b, h, n, dtype=torch.float64),
                     **{t: torch.zeros(b, h, min(t, window or t), dtype=torch.float64) for t in lens}}
        super()._observe(x, ctx)
        sums, self._fit = self._fit, {}
        keys = torch.arange(1, n + 1) if not window else torch.arange(1, n + 1).clamp(max=window)  # keys seen
        for t in lens:  # counts: sequences x heads, as the head means'
            r = lag_profile(sums["rows"][..., :t], sums[t], keys[:t])
            self.lags.add(f"{LAG}@{t}/{ctx.layer}", self.group, lag_partition(r, keys[:t]).sum((0, 1)), b * h)

    def _block(self, slot: int, s: int, e: int, k0: int, scores: torch.Tensor, allowed: torch.Tensor) -> None:
        """Row sums of the block's visible scores and, for each length T > s, their sums along each lag d = i - j
        over the block's queries below T."""
        b, h, rows, lags = scores.shape[0], scores.shape[1] * scores.shape[2], e - s, e - k0  # lags 0 .. e - 1 - k0
        # each row of the block behind `lags` zeros: in the flat buffer, row r's entry at lag d = i - j sits at
        # r * (2 lags + 1) + (s - k0 + 1) + (lags - 1 - d), so one strided view holds every diagonal as a column
        # (lags in reverse; keys before k0 read the zeros)
        padded = torch.empty(b, h, rows, 2 * lags, dtype=scores.dtype, device=scores.device)
        padded[..., :lags].zero_()
        z = torch.mul(scores.flatten(1, 2), allowed, out=padded[..., lags:])  # 0 where hidden (scores are finite)
        self._fit["rows"][..., s:e] += z.sum(-1).to(torch.float64).cpu()
        by_lag = padded.as_strided((b, h, rows, lags), (h * rows * 2 * lags, rows * 2 * lags, 2 * lags + 1, 1),
                                   padded.storage_offset() + s - k0 + 1)  # [B, H, rows, lag lags - 1 - d]
        for t, acc in self._fit.items():
            if t == "rows" or t <= s:
                continue
            d = min(lags, acc.shape[-1])
            acc[..., :d] += by_lag[..., : min(e, t) - s, :].sum(-2).flip(-1)[..., :d].to(torch.float64).cpu()

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
        of the maps (default: the whole length), with jackknife intervals (cut to each metric's `causal.SUPPORT`)."""
        size = self._n if n is None else n
        return self.metrics_at([size], level, names)[size]

    def metrics_at(self, lengths: list[int], level: float = 0.95, names: tuple[str, ...] | None = None
                   ) -> dict[int, dict[str, Estimate]]:
        """`metrics` at several lengths (top-left blocks), from one jackknife over the groups (each replicate's
        means are formed once for every length). Names in `LEAN` only: no fit beyond diagonal means. Each length
        must be one the lag fit ran at (`lengths`)."""
        gs = self.grouped()
        missing = [t for t in lengths if any(f"{LAG}@{t}/{layer}" not in gs for layer in self.layers)]
        if missing:
            raise UsageError(f"lengths {missing}: the capture fitted the lag profile at {self._fitted()} only; "
                             "pass every length the metrics are asked at as `lengths`")
        windows = [int(w) for w in self._window]
        layers = self.layers
        keys: list[str] = []
        lean = names is not None and set(names) <= set(LEAN)
        # the lean metrics take maps [..., n, n]: the layers of one window in one call; the full set one at a time
        same = [(w, [i for i, v in enumerate(windows) if v == w]) for w in dict.fromkeys(windows)] if lean else \
            [(w, [i]) for i, w in enumerate(windows)]

        def per_layer(m: dict[str, torch.Tensor]) -> torch.Tensor:
            out = []
            for size in lengths:
                cols: list[torch.Tensor | None] = [None] * len(layers)
                for w, at in same:
                    stacked = [layers[i] for i in at]
                    maps = {k: _stacked(m, k, stacked, size, 2) for k in KEYS if f"{k}/{stacked[0]}" in m}
                    maps["log_partition"] = _stacked(m, "log_partition", stacked, size, 1)
                    maps[LAG] = _stacked(m, f"{LAG}@{size}", stacked, size, 1)
                    vals = (lean_metrics if lean else leakage_metrics)(maps, Domain(window=w or None))
                    if not keys:
                        keys.extend(sorted(vals) if names is None else [k for k in names if k in vals])
                    for j, i in enumerate(at):
                        cols[i] = torch.stack([vals[k].reshape(len(at))[j] for k in keys])
                out.append(torch.stack(cols, 1))  # [metrics, layers]
            return torch.stack(out)  # [lengths, metrics, layers]

        est = gs.estimate(per_layer, level)
        return {size: {k: Estimate(est.value[a, i], est.lo[a, i], est.hi[a, i], est.se[a, i], est.groups, est.level,
                                   est.method, support=SUPPORT.get(k)) for i, k in enumerate(keys)}
                for a, size in enumerate(lengths)}

    def _fitted(self) -> list[int]:
        return sorted({int(k.split("@")[1].split("/")[0]) for k in self.lags.sums})

    # ---- persistence and combination: the capture's, and the lag sums beside them

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {**super().state_dict(), **{f"lags/{k}": v for k, v in self.lags.state_dict().items()}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        super().load_state_dict({k: v for k, v in state.items() if not k.startswith("lags/")})
        self.lags = GroupedSums(self.groups)
        self.lags.load_state_dict({k[5:]: v for k, v in state.items() if k.startswith("lags/")})

    def merge(self, other: Capture) -> None:
        super().merge(other)
        self.lags.merge(other.lags)

    def all_reduce(self, group=None) -> None:
        super().all_reduce(group)
        self.lags.all_reduce(group)

    def reset(self) -> None:
        super().reset()
        self.lags = GroupedSums(self.groups)

    def grouped(self, state: dict[str, torch.Tensor] | None = None) -> GroupedSums:
        """The capture's head-mean sums (`Capture.grouped`) and the lag log-partitions' (`LAG@T/LAYER`)."""
        gs = super().grouped(state)
        lags = self.lags
        if state is not None:
            lags = GroupedSums(self.groups)
            lags.load_state_dict({k[5:]: v for k, v in state.items() if k.startswith("lags/")})
        gs.sums.update(lags.sums)
        gs.counts.update(lags.counts)
        return gs

    def result(self, level: float = 0.95, metrics: bool = True) -> dict[str, torch.Tensor]:
        """The capture's mean maps (with `_se`) and, with `metrics`, every metric as `metric/NAME` [layers] with
        `_lo`, `_hi`, `_se`."""
        out = super().result(level=level)
        for name, est in (self.metrics(level) if metrics else {}).items():
            out.update(est.as_dict(f"metric/{name}"))
        return out
