"""Operations on averaged [n, n] score maps (query i on rows, key j on columns), shared by every command.

Diagonal normalisation (paper Section 5.1, Figure 4 bottom row): subtract from each diagonal i - j = k
its mean. What is left is the non-relative part of the map: a map that depends only on i - j (a
Toeplitz map, what a purely relative positional encoding produces) normalises to exactly zero.
"""

from __future__ import annotations

import numpy as np
import torch

from poslens.errors import UsageError


def as_numpy(m) -> np.ndarray:
    """float64 numpy copy of a tensor or array."""
    if isinstance(m, torch.Tensor):
        m = m.detach().cpu().to(torch.float64).numpy()
    return np.array(m, dtype=np.float64, copy=True)


def offsets(n: int) -> np.ndarray:
    """[n, n] matrix of i - j."""
    return np.arange(n)[:, None] - np.arange(n)[None, :]


def diagonal_means(m, causal: bool = True) -> np.ndarray:
    """Mean of each diagonal k = i - j over its finite entries; index k + n - 1 (k from -(n-1) to n-1).

    With causal=True only the lower diagonals k >= 0 are used (the upper ones are NaN). One pass over the
    map (a weighted bincount by offset), so O(n^2) for an n x n map.
    """
    m = as_numpy(m)
    n = m.shape[-1]
    k = (offsets(n) + n - 1).ravel()
    vals = m.ravel()
    ok = np.isfinite(vals) & ((k >= n - 1) if causal else True)
    sums = np.bincount(k[ok], weights=vals[ok], minlength=2 * n - 1)
    counts = np.bincount(k[ok], minlength=2 * n - 1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def diagonal_normalise(m, causal: bool = True) -> np.ndarray:
    """Subtract each diagonal's mean. causal=True: lower triangle only, the upper triangle becomes NaN.

    Works on one map [n, n] or a stack [..., n, n].
    """
    m = as_numpy(m)
    if m.ndim > 2:
        return np.stack([diagonal_normalise(x, causal) for x in m])
    n = m.shape[-1]
    k = offsets(n)
    mu = diagonal_means(m, causal)[k + n - 1]
    out = m - mu
    if causal:
        out[k < 0] = np.nan
    return out


def key_share(m) -> np.ndarray:
    """Per map [..., n, n]: share of the variance of the finite entries j < i explained by the key j alone (column
    means); 1 when the map does not depend on the query i (float64)."""
    x = as_numpy(m)
    n = x.shape[-1]
    vals = np.where(np.tril(np.ones((n, n), dtype=bool), -1), x, np.nan)[..., :, :-1]
    col = np.nanmean(vals, axis=-2, keepdims=True)
    tot = np.nansum((vals - np.nanmean(vals, axis=(-2, -1), keepdims=True)) ** 2, axis=(-2, -1))
    res = np.nansum((vals - col) ** 2, axis=(-2, -1))
    return 1 - res / tot


def quantile_limits(m, q: tuple[float, float] = (0.01, 0.99)) -> tuple[float, float]:
    """Colour limits at the given quantiles of the finite entries (the paper uses 1% and 99% for LLM maps)."""
    m = as_numpy(m)
    vals = m[np.isfinite(m)]
    if vals.size == 0:
        return 0.0, 1.0
    lo, hi = np.quantile(vals, q)
    if hi <= lo:
        hi = lo + 1e-12
    return float(lo), float(hi)


def toeplitz_residual(m, causal: bool = True, max_offset: int | None = None) -> dict:
    """How far a map is from depending on i - j alone.

    max_abs: largest |diagonal-normalised| entry; rms: its root mean square; fraction: share of the
    map's variance around its grand mean that the offset does not explain (0 for a Toeplitz map).
    max_offset limits the diagonals used (short diagonals near the corner have few entries).
    """
    m = as_numpy(m)
    r = diagonal_normalise(m, causal)
    if max_offset is not None:
        k = offsets(m.shape[-1])
        r = np.where(np.abs(k) <= max_offset, r, np.nan)
        m = np.where(np.abs(k) <= max_offset, m, np.nan)
    ok = np.isfinite(r)
    total = np.nansum((m[ok] - m[ok].mean()) ** 2)
    return {
        "max_abs": float(np.abs(r[ok]).max()),
        "rms": float(np.sqrt(np.mean(r[ok] ** 2))),
        "fraction": float(np.sum(r[ok] ** 2) / total) if total > 0 else 0.0,
    }


def rows_increasing(m, tol: float = 0.0) -> tuple[int, int]:
    """(rows whose scores strictly increase in j over keys j <= i, rows checked): the paper's Section 3 claim.

    Hidden pairs (NaN / inf) are ignored; rows with fewer than two finite entries are skipped. A row passes
    if every step between consecutive finite entries exceeds `tol`.
    """
    m = as_numpy(m)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise UsageError(f"scores must be a square [n, n] map, got shape {m.shape}")
    holding = checked = 0
    for i in range(1, m.shape[0]):
        row = m[i, : i + 1]
        row = row[np.isfinite(row)]
        if row.size < 2:
            continue
        checked += 1
        holding += bool(np.all(np.diff(row) > tol))
    return holding, checked


def row_step_violations(m, se) -> dict:
    """Steps m[i, j+1] - m[i, j] (j < i) that are not positive, and how large they are in standard errors.

    se is the standard error map of m; a step's standard error is taken as sqrt(se_a^2 + se_b^2)
    (conservative: ignores the positive correlation between neighbouring means).
    """
    m, se = as_numpy(m), as_numpy(se)
    worst, count, total = 0.0, 0, 0
    for i in range(1, m.shape[-1]):
        steps = np.diff(m[i, : i + 1])
        sd = np.sqrt(se[i, 1 : i + 1] ** 2 + se[i, :i] ** 2)
        bad = steps <= 0
        total += steps.size
        count += int(bad.sum())
        if bad.any():
            worst = max(worst, float(np.max(-steps[bad] / np.maximum(sd[bad], 1e-300))))
    return {"non_positive_steps": count, "steps": total, "worst_in_se": worst}
