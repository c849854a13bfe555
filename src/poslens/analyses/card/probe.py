"""`poslens stat position_probe MODEL`: a linear probe of absolute position from the residual stream, per layer,
scored on sequences it was not fitted on (held-out R^2 with an interval over folds).

One pass: per group of sequences g (batch b -> group b mod G, the engine's groups rule) and per hidden-state
index (0 = the embeddings, `blocks.0.hook_resid_pre`; l = after layer l, `blocks.{l-1}.hook_resid_post`) the
sums of the normal equations of position ~ x (x, x x^T, x t, t, t^2; float64). Each group is then a fold: the
ridge probe of `poslens.train.probe` (standardised features, relative ridge) is solved from the other groups' sums
and its squared error on the fold follows from the fold's own sums, so no prediction is ever scored on a sequence
its probe saw. R^2_k = 1 - SSE_k / SST_k (SST_k: the fold's squares about the fitted mean position, i.e. R^2 = 0 is
chance and an overfitted probe goes below 0); the result is the mean over folds with a t-interval over folds
(approximate: the folds' training sets overlap, so the spread over folds understates the variance a little, as
for any cross-validated score). Memory: G (L + 1) d^2 float64 numbers (SmolLM2-135M, 4 groups: 330 MB).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from poslens.engine.statistics.spec import Spec
from poslens.engine.stats import Estimate, Statistic, over_seeds
from poslens.errors import UsageError
from poslens.options import option
from poslens.train.probe import _ProbeFit, resid_points

R2 = (-math.inf, 1.0)  # a held-out R^2 cannot exceed 1 (it can fall below 0): every interval of one is cut to it


@dataclass
class ProbeOptions:
    """The probe's own parameters (flags of `poslens stat position_probe`)."""

    ridge: float = option(1e-2, lo=0, help="ridge penalty on the standardised features, relative to the number of "
                          "fitted tokens (as poslens.train.probe)")
    skip_first: int = option(1, lo=0, help="leave the first N positions out of the fit and the score (the BOS / "
                             "sink token at position 0 is trivially told apart)")


class PositionProbe(_ProbeFit):
    """The normal equations per group of sequences; `result` cross-fits over the groups (module docstring)."""

    name = "position_probe"
    intervals = "t-interval over {groups} folds (each group of sequences scored by the probe fitted on the others)"

    def __init__(self, groups: int, ridge: float = 1e-2, skip_first: int = 1) -> None:
        Statistic.__init__(self, groups)  # not _ProbeFit's single group
        self.ridge, self.skip_first = ridge, skip_first

    def hooks(self, hm) -> dict:
        return {p: self._reader(i) for i, p in enumerate(resid_points(hm.n_layers))}

    def check_length(self, seq_len: int) -> None:
        if seq_len - self.skip_first < 2:  # a fit of position needs two positions
            raise UsageError(f"skip_first {self.skip_first} leaves {max(seq_len - self.skip_first, 0)} of the "
                             f"{seq_len} positions of a sequence; the probe fits position on at least 2: give "
                             f"skip_first at most {seq_len - 2}", param="skip_first")

    def _reader(self, index: int):
        def read(x, ctx) -> None:  # x [B, T, d]; positions restart at 0 in every sequence
            x = x[:, self.skip_first:]
            if x.shape[1] < 2:
                return
            t = torch.arange(self.skip_first, self.skip_first + x.shape[1], dtype=torch.float64, device=x.device)
            self._add(index, x.double().reshape(-1, x.shape[-1]), t.repeat(x.shape[0]))
            ids = getattr(ctx, "input_ids", None)
            if index == 0 and ids is not None:  # which tokens each group read: two runs pair only on the same ones
                weights = torch.arange(1, ids.shape[1] + 1, dtype=torch.float64, device=ids.device)
                self.sums.add("tokens_checksum", self.group, (ids.double() * weights).sum(), 1)

        return read

    def _add(self, index: int, x: torch.Tensor, t: torch.Tensor) -> None:
        n = float(x.shape[0])
        g = self.group
        self.sums.add(f"x/{index}", g, x.sum(0), n)
        self.sums.add(f"xx/{index}", g, x.T @ x, n)
        self.sums.add(f"xt/{index}", g, x.T @ t, n)
        self.sums.add(f"t/{index}", g, t.sum(), n)
        self.sums.add(f"tt/{index}", g, (t * t).sum(), n)

    def fold_errors(self, index: int) -> list[tuple[float, float]]:
        """(SSE_k, SST_k) of every filled group k, its probe fitted on the other groups."""
        s = {k: self.sums.sums[f"{k}/{index}"].double() for k in ("x", "xx", "xt", "t", "tt")}
        n = self.sums.counts[f"x/{index}"].double()
        out = []
        for k in range(self.sums.groups):
            if float(n[k]) == 0 or float(n.sum() - n[k]) == 0:
                continue
            fit = _ProbeFit()
            for name in ("x", "xx", "xt", "t"):
                fit.sums.add(f"{name}/{index}", 0, s[name].sum(0) - s[name][k], float(n.sum() - n[k]))
            mean, scale, w, t_mean = fit.solve(index, self.ridge)
            u = w / scale  # t_hat = (x - mean) . u + t_mean
            nk = float(n[k])
            sx, sxx, sxt, st, stt = (s[name][k] for name in ("x", "xx", "xt", "t", "tt"))
            zz = sxx - torch.outer(sx, mean) - torch.outer(mean, sx) + nk * torch.outer(mean, mean)
            zt = sxt - t_mean * sx - mean * st + nk * mean * t_mean
            sst = float(stt - 2 * t_mean * st + nk * t_mean ** 2)
            sse = sst - 2 * float(u @ zt) + float(u @ zz @ u)
            out.append((max(sse, 0.0), sst))
        return out

    def result(self, level: float = 0.95) -> dict[str, torch.Tensor]:
        """`r2` [L + 1] (mean over folds, with `_lo`/`_hi`/`_se`: t over folds, cut at 1), `r2_pooled` (1 - the summed
        SSE over the summed SST), `folds`, `r2_folds` [L + 1, folds] (R^2 of each fold) and `tokens_checksum`
        [G] (sum of token id x (position + 1) per group: equal in two runs that read the same tokens in the same
        groups, so that their per-fold R^2 can be paired)."""
        indices = sorted({int(name.split("/")[1]) for name in self.sums.names() if "/" in name})
        ests, pooled, folds, per_fold = [], [], [], []
        for i in indices:
            errs = self.fold_errors(i)
            r2 = [1.0 - sse / sst if sst > 0 else math.nan for sse, sst in errs]
            per_fold.append(r2)
            est = over_seeds(r2, level, R2)
            ests.append(dataclasses.replace(est, method="t over folds"))
            total = sum(sst for _, sst in errs)
            pooled.append(1.0 - sum(sse for sse, _ in errs) / total if total > 0 else math.nan)
            folds.append(len(errs))
        est = Estimate(*(torch.stack([getattr(e, k) for e in ests]) for k in ("value", "lo", "hi", "se")),
                       groups=min(folds), level=level, method="t over folds", support=R2)
        out = {**est.as_dict("r2"), "r2_pooled": torch.tensor(pooled, dtype=torch.float64),
               "folds": torch.tensor(folds, dtype=torch.float64)}
        if len(set(folds)) == 1:  # every index scored on the same folds: R^2 per fold, for paired differences
            out["r2_folds"] = torch.tensor(per_fold, dtype=torch.float64)
        if "tokens_checksum" in self.sums:
            out["tokens_checksum"] = self.sums.sums["tokens_checksum"].double()
        return out


SPEC = Spec("position_probe", "held-out R^2 of a linear probe of absolute position from the residual stream, per "
            "layer (0 = embeddings), cross-fitted over the groups of sequences", ProbeOptions,
            lambda hm, options, groups: PositionProbe(groups, options.ridge, options.skip_first))
