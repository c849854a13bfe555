"""The predecessor's method (Ruscio, "Once upon a token"): linear Delta R^2 per head with a shuffled-input null.

Per sequence, layer and head, the post-RoPE scores y_ij = q_i . k_j over the causal pairs j <= i (no 1/sqrt(d):
R^2 is scale-free) are fitted by ordinary least squares with an intercept on
    X_rel  = [1, i - j]            (offset only)
    X_full = [1, i - j, i, j]      (offset plus absolute query and key position; rank 3, since i - j = i - j)
on a random 70% of the pairs, and scored by R^2 on the other 30%: Delta R^2 = R^2_full - R^2_rel.
The null re-runs the model on the same tokens circularly shifted by a random k; per head, the gap is the mean
over sequences of Delta R^2 (real) - Delta R^2 (null), with a percentile bootstrap interval (2,000 resamples),
a one-sided sign-flip permutation p-value (5,000 flips; H1: real > null) and Benjamini-Hochberg control of
the false discovery rate over all heads (q = 0.05). The linear design cannot see non-linear absolute terms
such as -log(i + 1); `metrics.delta_r2` is the one-hot generalisation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from poslens.errors import UsageError, check_float, check_int

TEST_FRACTION = 0.3
BOOTSTRAP = 2000
PERMUTATIONS = 5000
FDR = 0.05


def causal_pairs(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(i, j) of every causal pair j <= i of an n-token sequence, row by row."""
    i, j = torch.tril_indices(n, n)
    return i, j


def split_pairs(n: int, test_fraction: float = TEST_FRACTION, seed: int = 0) -> torch.Tensor:
    """[n (n + 1) / 2] bool over `causal_pairs(n)`: True for the held-out (test) pairs, a seeded random share."""
    check_float("test_fraction", test_fraction, 0.0, 1.0, hi_open=True)
    k = n * (n + 1) // 2
    g = torch.Generator().manual_seed(int(seed))
    test = torch.zeros(k, dtype=torch.bool)
    test[torch.randperm(k, generator=g)[: round(test_fraction * k)]] = True
    return test


def _design(i: torch.Tensor, j: torch.Tensor, full: bool) -> torch.Tensor:
    i, j = i.to(torch.float64), j.to(torch.float64)
    cols = [torch.ones_like(i), i - j] + ([i, j] if full else [])
    return torch.stack(cols, 1)


@functools.lru_cache(maxsize=16)
def _solver(n: int, test_fraction: float, seed: int) -> tuple:
    """The train / test pairs and, per design (full, rel), the train pseudo-inverse and the test design."""
    i, j = causal_pairs(n)
    if test_fraction > 0:
        test = split_pairs(n, test_fraction, seed)
        train = ~test
    else:
        train = test = torch.ones(len(i), dtype=torch.bool)
    if int(train.sum()) < 4 or int(test.sum()) < 2:
        raise UsageError(f"seq_len {n} gives too few causal pairs for the train/test split; use a longer seq_len")
    designs = [_design(i, j, full) for full in (True, False)]
    return train, test, [(torch.linalg.pinv(x[train]).T, x[test].T) for x in designs]


def _r2(y: torch.Tensor, pinv_t: torch.Tensor, x_test_t: torch.Tensor, train, test) -> torch.Tensor:
    """Out-of-sample R^2 on `test` of the OLS fit of y [..., K] over `train` (minimum-norm solve)."""
    coef = y[..., train] @ pinv_t  # [..., p]
    yt = y[..., test]
    res = yt - coef @ x_test_t
    tot = ((yt - yt.mean(-1, keepdim=True)) ** 2).sum(-1)
    return 1.0 - (res**2).sum(-1) / tot


def linear_delta_r2(scores: torch.Tensor, test_fraction: float = TEST_FRACTION, seed: int = 0) -> torch.Tensor:
    """Delta R^2 = R^2_full - R^2_rel of score maps [..., n, n] (entries j <= i used), over the leading axes.

    test_fraction 0 fits and scores on all pairs (in-sample; then Delta R^2 >= 0 always).
    """
    scores = torch.as_tensor(scores)
    n = scores.shape[-1]
    check_int("n", n, 3)
    check_float("test_fraction", test_fraction, 0.0, 1.0, hi_open=True)
    train, test, ((pf, xf), (pr_, xr)) = _solver(n, float(test_fraction), int(seed))
    i, j = causal_pairs(n)
    y = scores[..., i, j].to(torch.float64)
    return _r2(y, pf, xf, train, test) - _r2(y, pr_, xr, train, test)


def circular_shift(ids: torch.Tensor, shift: int | torch.Tensor, keep: int = 0) -> torch.Tensor:
    """Token ids [B, T] rolled by `shift` along the sequence (per row when a tensor [B]); the first `keep`
    positions (an auto-prepended BOS) stay in place. The predecessor's null input."""
    ids = torch.as_tensor(ids)
    body = ids[:, keep:]
    t = body.shape[1]
    shift = torch.as_tensor(shift).expand(ids.shape[0])
    idx = (torch.arange(t)[None, :] - shift[:, None]) % t
    return torch.cat([ids[:, :keep], body.gather(1, idx)], 1)


@dataclass
class PairedTest:
    """Per head: gap = mean (real - null), its bootstrap interval [lo, hi], the sign-flip p-value and whether
    it survives Benjamini-Hochberg at `fdr` over all heads."""

    gap: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    p: torch.Tensor
    significant: torch.Tensor
    fdr: float
    level: float

    def as_dict(self) -> dict:
        return {"gap": self.gap, "lo": self.lo, "hi": self.hi, "p": self.p, "significant": self.significant,
                "fdr": self.fdr, "level": self.level}


def benjamini_hochberg(p: torch.Tensor, q: float = FDR) -> torch.Tensor:
    """Rejections of the Benjamini-Hochberg step-up procedure at false discovery rate q, same shape as p."""
    check_float("fdr", q, 0.0, 1.0, lo_open=True)
    flat = torch.as_tensor(p, dtype=torch.float64).reshape(-1)
    m = flat.numel()
    order = torch.argsort(flat)
    below = flat[order] <= q * torch.arange(1, m + 1, dtype=torch.float64) / m
    k = int(below.nonzero().max()) + 1 if bool(below.any()) else 0  # the largest rank under its line
    reject = torch.zeros(m, dtype=torch.bool)
    reject[order[:k]] = True
    return reject.reshape(torch.as_tensor(p).shape)


def paired_test(real: torch.Tensor, null: torch.Tensor, bootstrap: int = BOOTSTRAP,
                permutations: int = PERMUTATIONS, level: float = 0.95, fdr: float = FDR,
                seed: int = 0) -> PairedTest:
    """Compare per-sequence statistics real [N, ...] with null [N, ...] (paired by sequence), per trailing index."""
    real, null = torch.as_tensor(real, dtype=torch.float64), torch.as_tensor(null, dtype=torch.float64)
    if real.shape != null.shape:
        raise UsageError(f"real and null must have the same shape, got {tuple(real.shape)} and {tuple(null.shape)}")
    n = real.shape[0]
    if n < 2:
        raise UsageError(f"the paired test needs at least 2 sequences, got {n}; raise num_sequences")
    check_int("bootstrap", bootstrap, 1)
    check_int("permutations", permutations, 1)
    check_float("level", level, 0.0, 1.0, lo_open=True, hi_open=True)
    g = torch.Generator().manual_seed(int(seed))
    diff = real - null
    gap = diff.mean(0)
    means = torch.stack([diff[torch.randint(n, (n,), generator=g)].mean(0) for _ in range(bootstrap)])
    lo = torch.quantile(means, (1 - level) / 2, dim=0)
    hi = torch.quantile(means, (1 + level) / 2, dim=0)
    exceed = torch.zeros_like(gap)
    for _ in range(permutations):
        signs = torch.randint(0, 2, (n,), generator=g).to(torch.float64) * 2 - 1
        flipped = (diff * signs.view(-1, *[1] * (diff.dim() - 1))).mean(0)
        exceed += (flipped >= gap).to(torch.float64)
    p = (exceed + 1) / (permutations + 1)
    return PairedTest(gap, lo, hi, p, benjamini_hochberg(p, fdr), fdr, level)
