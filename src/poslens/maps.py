"""Operations on averaged [n, n] score maps (query i on rows, key j on columns), shared by every command.

Diagonal normalisation (paper Section 5.1, Figure 4 bottom row): subtract from each diagonal i - j = k
its mean. What is left is the non-relative part of the map: a map that depends only on i - j (a
Toeplitz map, what a purely relative positional encoding produces) normalises to exactly zero.
"""

from __future__ import annotations

import numpy as np
import torch

from poslens.errors import UsageError
from poslens.masks import nan_hidden


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

    With causal=True only the lower diagonals k >= 0 are used (the upper ones are NaN). `diagonal_sums` in
    float64: one pass over the map, so O(n^2) for an n x n map.
    """
    sums, counts = diagonal_sums(torch.from_numpy(as_numpy(m)), causal)
    return torch.where(counts > 0, sums / counts.clamp(min=1), torch.nan)[..., :-1].numpy()


def diagonal_sums(m: torch.Tensor, causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(sums, counts) [..., 2n] of the finite entries of each diagonal k = i - j of maps m [..., n, n], at index
    k + n - 1; the last bin holds what is left out (the upper diagonals when causal). One scatter-add by offset
    over all maps at once, in m's dtype, each bin summed in row-major order."""
    n = m.shape[-1]
    flat = m.reshape(-1, n * n)
    k = (torch.arange(n)[:, None] - torch.arange(n)[None]).to(m.device)
    idx = (torch.where(k >= 0, k + n - 1, 2 * n - 1) if causal else k + n - 1).reshape(1, -1).expand_as(flat)
    ok = torch.isfinite(flat) & (idx < 2 * n - 1)
    sums = torch.zeros(flat.shape[0], 2 * n, dtype=m.dtype, device=m.device).scatter_add_(1, idx, flat.where(ok, 0))
    counts = torch.zeros_like(sums).scatter_add_(1, idx, ok.to(m.dtype))
    return sums.reshape(*m.shape[:-2], 2 * n), counts.reshape(*m.shape[:-2], 2 * n)


def diagonal_normalised(m: torch.Tensor, causal: bool = True) -> torch.Tensor:
    """Each diagonal i - j = k of maps m [..., n, n] minus its mean over finite entries (`diagonal_sums`); with
    causal=True the lower diagonals only, the upper triangle NaN (Figure 8). The one diagonal normalisation."""
    n = m.shape[-1]
    sums, counts = diagonal_sums(m, causal)
    mean = torch.where(counts > 0, sums / counts.clamp(min=1), torch.nan).reshape(-1, 2 * n)
    k = (torch.arange(n)[:, None] - torch.arange(n)[None]).to(m.device)
    idx = (k + n - 1).reshape(1, -1).expand(mean.shape[0], -1)
    out = (m.reshape(-1, n * n) - mean.gather(1, idx)).reshape(m.shape)
    return nan_hidden(out) if causal else out


def diagonal_normalise(m, causal: bool = True) -> np.ndarray:
    """`diagonal_normalised` of a tensor or array as a float64 numpy array: subtract each diagonal's mean;
    causal=True: lower triangle only, the upper triangle becomes NaN. One map [n, n] or a stack [..., n, n]."""
    return diagonal_normalised(torch.from_numpy(as_numpy(m)), causal).numpy()


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
