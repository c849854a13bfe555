"""Statistics of averaged [n, n] score maps (query i on rows, key j on columns) that the report's claims test.

Pure float64 functions of mean maps, so every one of them gets a jackknife interval from grouped means
(`poslens.engine.stats.GroupedSums.estimate`). `sink=True` leaves out key 0 (the attention-sink column of real
models) before anything is computed. Where a statistic's square would carry a noise term (a mean square of a
noisy map), it takes two independent halves a and b: E[P(m_a) P(m_b)] has no noise term.
"""

from __future__ import annotations

import numpy as np
import torch

from poslens.maps import as_numpy, diagonal_normalise


def _np(m) -> np.ndarray:
    return as_numpy(m)


def lower(n: int, diagonal: bool = False, sink: bool = False) -> np.ndarray:
    """Mask of the entries j < i (j <= i with diagonal=True); sink=True drops key 0."""
    mask = np.tril(np.ones((n, n), dtype=bool), 0 if diagonal else -1)
    if sink:
        mask[:, 0] = False
    return mask


def without_sink(m) -> np.ndarray:
    """Maps [..., n, n] with the key-0 column set to NaN, float64."""
    x = _np(m)
    x[..., :, 0] = np.nan
    return x


def normalised(m, sink: bool = False) -> np.ndarray:
    """Diagonal-normalised maps (each lower diagonal minus its mean); sink=True first blanks key 0."""
    return diagonal_normalise(without_sink(m) if sink else _np(m))


def _t(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, dtype=np.float64))


# a non-relative part (or asymmetry) whose mean square is under a thousandth of the map's variance is negligible:
# the margin that lets a "present" test of a quantity that cannot fall below 0 fail (claims.Test.margin)
NEGLIGIBLE = 1e-3


def pattern_power(ma, mb, sink: bool = False) -> torch.Tensor:
    """Per map: E[P(m_a) P(m_b)] over the entries j <= i (1 <= j with sink): the mean square of the
    non-relative pattern without its noise term. ma, mb: [..., n, n] means of two independent halves."""
    pa, pb = normalised(ma, sink), normalised(mb, sink)
    mask = lower(pa.shape[-1], diagonal=True, sink=sink)
    return _t((pa * pb)[..., mask].mean(axis=-1))


def band_share(ma, mb) -> torch.Tensor:
    """Per map: the noise-free share of the variance of the entries j < i that lies within the bands of fixed
    offset i - j: E[P(m_a) P(m_b)] / Var(m) over j < i (0 for a relative map, whose bands are constant)."""
    pa, pb = normalised(ma), normalised(mb)
    mask = lower(pa.shape[-1])
    v = ((_np(ma) + _np(mb)) / 2)[..., mask]
    return _t((pa * pb)[..., mask].mean(axis=-1) / v.var(axis=-1))


def row_slope(m) -> torch.Tensor:
    """Per map: mean over rows i of the least-squares slope of m[i, j] in j over 0 <= j < i (rows with at least
    two such keys): positive when closer keys score higher."""
    x = _np(m)
    n = x.shape[-1]
    out = []
    for i in range(2, n):
        j = np.arange(i, dtype=np.float64)
        jc = j - j.mean()
        out.append(((x[..., i, :i] - x[..., i, :i].mean(-1, keepdims=True)) * jc).sum(-1) / (jc**2).sum())
    return _t(np.mean(out, axis=0))


def map_variance(m, sink: bool = False) -> torch.Tensor:
    """Per map: variance of the entries j <= i (1 <= j with sink) around their mean (the scores' own scale)."""
    x = _np(m)
    v = x[..., lower(x.shape[-1], diagonal=True, sink=sink)]
    return _t(((v - v.mean(axis=-1, keepdims=True)) ** 2).mean(axis=-1))


def noise_power(ma, mb, sink: bool = False) -> torch.Tensor:
    """Per map: E[((P(m_a) - P(m_b)) / 2)^2], the mean-square noise of the pooled normalised map."""
    pa, pb = normalised(ma, sink), normalised(mb, sink)
    return _t((((pa - pb) / 2) ** 2)[..., lower(pa.shape[-1], diagonal=True, sink=sink)].mean(axis=-1))


def offdiag_std(m) -> torch.Tensor:
    """Per map: standard deviation of the entries j < i: how strong the position-dependent pattern is."""
    x = _np(m)
    return _t(np.nanstd(x[..., lower(x.shape[-1])], axis=-1))


def offset_share(m) -> torch.Tensor:
    """Per map: share of the variance of the entries j < i explained by the offset i - j alone (a relative map: 1)."""
    x = _np(m)
    mask = lower(x.shape[-1])
    r = diagonal_normalise(np.where(mask, x, np.nan))[..., mask]
    v = x[..., mask]
    return _t(1 - (r**2).sum(-1) / ((v - v.mean(-1, keepdims=True)) ** 2).sum(-1))


def relative_size(m) -> torch.Tensor:
    """Per map: standard deviation over the entries j < i of their diagonal's mean (the relative part's size)."""
    x = _np(m)
    mask = lower(x.shape[-1])
    rel = (np.where(mask, x, np.nan) - diagonal_normalise(np.where(mask, x, np.nan)))[..., mask]
    return _t(rel.std(axis=-1))


def antidiagonal_power(ma, mb) -> torch.Tensor:
    """Per map: E[D(m_a) D(m_b)] / var(m) over j < i, D(m) = m(i, j) - m(n-1-j, n-1-i): the noise-free mean square
    of the asymmetry across the bottom-left to top-right axis relative to the map's variance (0 for symmetric maps)."""
    a, b = _np(ma), _np(mb)
    n = a.shape[-1]
    mask = lower(n)

    def d(x):
        return (x - x[..., ::-1, ::-1].swapaxes(-1, -2))[..., mask]

    v = ((a + b) / 2)[..., mask]
    return _t((d(a) * d(b)).mean(-1) / v.var(-1))


def correlation(x, y) -> torch.Tensor:
    """Pearson correlation of the entries j < i of two maps (same shape)."""
    a, b = _np(x), _np(y)
    mask = lower(a.shape[-1])
    u, v = a[..., mask], b[..., mask]
    u, v = u - u.mean(-1, keepdims=True), v - v.mean(-1, keepdims=True)
    return _t((u * v).sum(-1) / np.sqrt((u * u).sum(-1) * (v * v).sum(-1)))


def block_mean(m, rows: slice, keys: slice, sink: bool = False) -> torch.Tensor:
    """Per map: mean of the diagonal-normalised map over queries `rows` and keys `keys` (entries j <= i)."""
    p = normalised(m, sink)[..., rows, keys]
    return _t(np.nanmean(p, axis=(-2, -1)))


def rise_share(m, row: int, keys: int) -> torch.Tensor:
    """Per map: how much of query `row`'s rise from key 0 to key row-1 is reached by key `keys`:
    (m[row, keys] - m[row, 0]) / (m[row, row-1] - m[row, 0]); near 1 when the row saturates early."""
    x = _np(m)
    return _t((x[..., row, keys] - x[..., row, 0]) / (x[..., row, row - 1] - x[..., row, 0]))


def need_factor(value: float, lo: float, hi: float, threshold: float = 0.0) -> float:
    """By how much the sample (sequences, Monte Carlo samples) must grow for an interval [lo, hi] about `value` to
    just exclude `threshold` if the estimate stayed where it is (the half-width shrinks as 1/sqrt(sample))."""
    return ((hi - lo) / 2 / (value - threshold)) ** 2


def step_bounds(m, se, z: float) -> dict:
    """Steps s = m[i, j+1] - m[i, j] over 0 <= j < i (the claim 'strictly increasing in j'): the smallest step,
    the smallest lower bound s - z SE and the smallest upper bound s + z SE (SE of a step: sqrt(se_j^2 +
    se_{j+1}^2), conservative), how many steps there are, how many rows have a step <= 0, need_factor: by how
    much the samples must grow for every step's lower bound to clear 0 at the present estimates (None when some
    step estimates <= 0), and fail_factor: by how much they must grow for the upper bound of the step that is
    below 0 by the most standard errors to fall below 0 (None when no step estimates < 0)."""
    x, e = _np(m), _np(se)
    steps, errs = [], []
    for i in range(1, x.shape[-1]):
        steps.append(np.diff(x[i, : i + 1]))
        errs.append(np.sqrt(e[i, 1 : i + 1] ** 2 + e[i, :i] ** 2))
    s, er = np.concatenate(steps), np.concatenate(errs)
    need = float(np.max((z * er / s) ** 2)) if (s > 0).all() else None
    fail = float(np.min((z * er[s < 0] / s[s < 0]) ** 2)) if (s < 0).any() else None
    return {"min": float(s.min()), "lo": float((s - z * er).min()), "hi": float((s + z * er).min()),
            "steps": int(s.size), "need_factor": need, "fail_factor": fail,
            "rows_failing": int(sum(bool((d <= 0).any()) for d in steps))}


def dips(m) -> dict:
    """Rows whose scores are not strictly increasing in j <= i (an exact map): how many, the first such row
    (1-based), and the largest decrease m[i, j] - m[i, j+1]."""
    x = _np(m)
    rows, worst = [], 0.0
    for i in range(1, x.shape[-1]):
        d = np.diff(x[i, : i + 1])
        if (d <= 0).any():
            rows.append(i + 1)
            worst = max(worst, float(-d.min()))
    return {"rows": len(rows), "first_row": rows[0] if rows else None, "largest": worst}


def max_offdiag_z(m, se) -> float:
    """Largest |m[i, j]| / se[i, j] over j < i: how far the off-diagonal entries are from 0 in standard errors."""
    x, e = _np(m), _np(se)
    mask = lower(x.shape[-1])
    return float(np.nanmax(np.abs(x[mask]) / e[mask]))


def bonferroni_z(tests: int, level: float = 0.95) -> float:
    """Two-sided normal quantile for `tests` simultaneous comparisons at family-wise `level`."""
    from statistics import NormalDist

    return NormalDist().inv_cdf(1 - (1 - level) / (2 * tests))
