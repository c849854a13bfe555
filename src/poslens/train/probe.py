"""Section 4.2 pieces on trained models: a linear probe of absolute position, and held-out losses compared.

`position_probe` follows Haviv et al. (2022): how well can the absolute position of a token be read from
each layer's hidden states? Here with a linear (ridge) regression fitted on some sequences and scored on
others, as the mean absolute error in tokens. Chance (predicting the mean position) is about T/4 for
positions uniform on 0..T-1 (E|U - (T-1)/2| ~ T/4); the embeddings of a model without positional encoding
carry no position, so index 0 sits at chance, and any causal attention layer can do better (Kazemnejad et
al. 2023).

Both passes run on the hook engine (`blocks.0.hook_resid_pre` for the embeddings, `blocks.{l}.hook_resid_post`
after layer l + 1) through `run_statistics`. The fit pass accumulates the normal equations per hidden-state
index (sums of x, x x^T, x t, t; float64), so memory is O(L d^2) whatever the number of sequences; the test pass
adds |t_hat - t| per group of sequences, so every MAE (and every difference of two MAEs) has a delete-a-group
jackknife interval. The interval covers the test sequences; the fitted probe is held fixed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from poslens.engine.stats import DEFAULT_GROUPS, NONNEGATIVE, Estimate, GroupedSums, Statistic
from poslens.errors import check_float, check_int, require


@dataclass
class ProbeResult:
    """Held-out mean absolute error (tokens) per hidden-state index (0 = embeddings, l = after layer l), with
    intervals; `chance` is the error of always predicting the fit set's mean position."""

    mae: list[Estimate]
    chance: Estimate
    seq_len: int
    sums: GroupedSums  # the per-group error sums, for intervals of any function of the MAEs

    def values(self) -> list[float]:
        return [float(e.value) for e in self.mae]

    def difference(self, a: int, b: int, level: float = 0.95) -> Estimate:
        """MAE(b) - MAE(a) with a paired jackknife interval (both scored on the same test sequences)."""
        return self.sums.estimate(lambda m: m[f"err/{b}"] - m[f"err/{a}"], level)


def resid_points(n_layers: int) -> list[str]:
    """Hook points of hidden-state indices 0..L: the embeddings, then each layer's output."""
    return ["blocks.0.hook_resid_pre"] + [f"blocks.{l}.hook_resid_post" for l in range(n_layers)]


class _ProbeFit(Statistic):
    """Sums of the normal equations of position ~ x per hidden-state index (one group: no interval needed)."""

    name = "probe_fit"

    def __init__(self) -> None:
        super().__init__(groups=1)

    def hooks(self, hm) -> dict:
        return {p: self._reader(i) for i, p in enumerate(resid_points(hm.n_layers))}

    def _reader(self, index: int):
        def read(x, ctx) -> None:  # x: [B, T, d]; positions restart at 0 in every sequence
            t = torch.arange(x.shape[1], dtype=torch.float64, device=x.device).repeat(x.shape[0])
            self._add(index, x.double().reshape(-1, x.shape[-1]), t)

        return read

    def _add(self, index: int, x: torch.Tensor, t: torch.Tensor) -> None:
        n = float(x.shape[0])
        self.sums.add(f"x/{index}", 0, x.sum(0), n)
        self.sums.add(f"xx/{index}", 0, x.T @ x, n)
        self.sums.add(f"xt/{index}", 0, x.T @ t, n)
        self.sums.add(f"t/{index}", 0, t.sum(), n)

    def solve(self, index: int, ridge: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]:
        """(mean, scale, w, t_mean): the ridge probe on standardised features, t_hat = ((x - mean) / scale) w + t_mean.
        `ridge` is relative (multiplied by the number of fitted tokens), so it does not depend on the data size."""
        m = {k: self.sums.mean(f"{k}/{index}") for k in ("x", "xx", "xt", "t")}
        mean = m["x"]
        cov = m["xx"] - torch.outer(mean, mean)  # E[x x^T] - mean mean^T
        scale = torch.diagonal(cov).clamp_min(0).sqrt().clamp_min(1e-12)
        zz = cov / torch.outer(scale, scale)  # standardised Gram / n
        zt = (m["xt"] - mean * m["t"]) / scale  # standardised, centred X^T t / n
        w = torch.linalg.solve(zz + ridge * torch.eye(zz.shape[0], dtype=torch.float64, device=zz.device), zt)
        return mean, scale, w, float(m["t"])


class _ProbeError(Statistic):
    """Sum of |t_hat - t| per group of test sequences for every hidden-state index, and for the mean position."""

    name = "probe_error"

    def __init__(self, probes: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]], groups: int) -> None:
        super().__init__(groups)
        self.probes = probes

    def hooks(self, hm) -> dict:
        return {p: self._reader(i) for i, p in enumerate(resid_points(hm.n_layers))}

    def _reader(self, index: int):
        def read(x, ctx) -> None:
            b, t_len, d = x.shape
            mean, scale, w, t_mean = self.probes[index]
            t = torch.arange(t_len, dtype=torch.float64, device=x.device)
            pred = ((x.double() - mean) / scale) @ w + t_mean  # [B, T]
            self.sums.add(f"err/{index}", self.group, (pred - t).abs().sum(), b * t_len)
            if index == 0:
                self.sums.add("chance", self.group, (t_mean - t).abs().sum() * b, b * t_len)

        return read


def position_probe(model: torch.nn.Module, fit_blocks: torch.Tensor, test_blocks: torch.Tensor,
                   ridge: float = 1e-2, groups: int = DEFAULT_GROUPS, batch_size: int = 8,
                   level: float = 0.95) -> ProbeResult:
    """Fit a ridge probe of the absolute position (0..T-1 within each block) on `fit_blocks` [N, T] per
    hidden-state index; score it on `test_blocks` [M, T] with a jackknife interval over `groups` groups of test
    batches. Features are standardised with the fit set's mean and scale, so `ridge` is scale-free."""
    from poslens.engine.hooks import HookedModel
    from poslens.engine.runner import run_statistics

    require(fit_blocks.dim() == 2 and test_blocks.dim() == 2 and fit_blocks.shape[1] == test_blocks.shape[1],
            "fit_blocks and test_blocks must be [N, T] token tensors of the same T")
    check_float("ridge", ridge, 0.0, math.inf)
    check_int("batch_size", batch_size, 1)
    hm = HookedModel(model)
    fit = _ProbeFit()
    model.eval()
    with torch.no_grad():
        run_statistics(hm, [fit], list(fit_blocks.split(batch_size)), all_reduce=False)
        probes = [fit.solve(i, ridge) for i in range(hm.n_layers + 1)]
        err = _ProbeError(probes, groups)
        run_statistics(hm, [err], list(test_blocks.split(batch_size)), all_reduce=False)
    mae = [err.sums.estimate(lambda m, i=i: m[f"err/{i}"], level, support=NONNEGATIVE) for i in range(hm.n_layers + 1)]
    return ProbeResult(mae=mae, chance=err.sums.estimate(lambda m: m["chance"], level, support=NONNEGATIVE),
                       seq_len=fit_blocks.shape[1], sums=err.sums)


def heldout_losses(models: dict[str, torch.nn.Module], blocks: torch.Tensor, groups: int = DEFAULT_GROUPS,
                   batch_size: int = 8) -> GroupedSums:
    """Mean next-token cross-entropy of each model on the same held-out `blocks` [N, T], kept per group of
    batches (batch b -> group b mod G) as sums named `loss/NAME`, so any difference has a paired interval."""
    check_int("batch_size", batch_size, 1)
    sums = GroupedSums(groups)
    with torch.no_grad():
        for name, model in models.items():
            model.eval()
            device = model.get_input_embeddings().weight.device
            for b, chunk in enumerate(blocks.split(batch_size)):
                chunk = chunk.to(device)
                logits = model(input_ids=chunk[:, :-1]).logits.float()
                nll = F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum")
                sums.add(f"loss/{name}", b, nll.double(), chunk[:, 1:].numel())
    return sums


def loss_comparison(sums: GroupedSums, a: str = "none", b: str = "rope", level: float = 0.95) -> dict[str, dict]:
    """Held-out loss of `a` and `b`, their difference a - b and the perplexity ratio exp(a - b), with intervals."""
    return {"loss_" + a: sums.estimate(lambda m: m[f"loss/{a}"], level, support=NONNEGATIVE).item(),
            "loss_" + b: sums.estimate(lambda m: m[f"loss/{b}"], level, support=NONNEGATIVE).item(),
            "gap": sums.estimate(lambda m: m[f"loss/{a}"] - m[f"loss/{b}"], level).item(),
            "perplexity_ratio": sums.estimate(lambda m: torch.exp(m[f"loss/{a}"] - m[f"loss/{b}"]), level,
                                              support=NONNEGATIVE).item()}


def sequences_of(tokens, seq_len: int, count: int, offset: int = 0, bos: int | None = None) -> torch.Tensor:
    """`count` consecutive non-overlapping blocks of `seq_len` tokens of a 1-D token array (a token file's memory
    map, a numpy array or a tensor), from block `offset`, as int64 [count, seq_len]; with `bos`, each block is the
    BOS and then seq_len - 1 tokens of the array, as a model trained with a BOS (`poslens train --bos`) saw them."""
    body = seq_len - (bos is not None)
    require(body >= 1, f"seq_len must leave room for a token after the BOS (got {seq_len})")
    ids = torch.as_tensor(np.asarray(tokens[offset * body:(offset + count) * body], dtype=np.int64))
    require(ids.numel() == count * body, f"the held-out tokens hold fewer than {offset + count} sequences of "
                                         f"{body} tokens; use fewer sequences or more held-out text")
    if bos is not None:
        return torch.cat([torch.full((count, 1), bos, dtype=torch.long), ids.reshape(count, body)], dim=1)
    return ids.reshape(count, body)
