"""Diagonal normalisation and the relativity metrics: exact properties."""

import numpy as np
import pytest

from poslens.maps import (
    diagonal_means,
    diagonal_normalise,
    quantile_limits,
    row_step_violations,
    rows_increasing,
    toeplitz_residual,
)


def toeplitz(n, f):
    i, j = np.indices((n, n))
    return f(i - j).astype(float)


def test_toeplitz_map_normalises_to_zero_both_ways():
    m = toeplitz(12, lambda k: np.cos(0.3 * k) - 0.01 * k**2)
    assert np.nanmax(np.abs(diagonal_normalise(m, causal=False))) < 1e-12
    r = diagonal_normalise(m, causal=True)
    assert np.all(np.isnan(r[np.triu_indices(12, 1)]))
    assert np.nanmax(np.abs(r)) < 1e-12
    assert toeplitz_residual(m, causal=False)["fraction"] < 1e-20


def test_non_toeplitz_residual_is_the_absolute_part():
    # m = f(i - j) + a(j): normalising removes f and the per-diagonal mean of a(j), leaving a(j) - mean_k.
    n = 10
    i, j = np.indices((n, n))
    a = np.log1p(j)
    m = np.cos(i - j) + a
    r = diagonal_normalise(m, causal=True)
    for k in range(n):
        d = np.diagonal(r, -k)
        assert np.allclose(d, np.log1p(np.arange(n - k)) - np.log1p(np.arange(n - k)).mean())
    # every diagonal of the residual has zero mean (what the operation guarantees)
    for k in range(n):
        assert abs(np.diagonal(r, -k).mean()) < 1e-12


def test_diagonal_means_match_numpy_diagonals():
    rng = np.random.default_rng(0)
    m = rng.normal(size=(7, 7))
    mu = diagonal_means(m, causal=False)
    for k in range(-6, 7):
        assert mu[k + 6] == pytest.approx(np.diagonal(m, -k).mean())
    assert np.all(np.isnan(diagonal_means(m, causal=True)[:6]))


def test_quantile_limits_ignore_nan():
    m = np.full((4, 4), np.nan)
    m[np.tril_indices(4)] = np.arange(10)
    assert quantile_limits(m, (0.0, 1.0)) == (0.0, 9.0)


def test_rows_increasing_and_violations():
    n = 6
    i, j = np.indices((n, n))
    m = np.where(j <= i, j - i, np.nan).astype(float)  # increasing in j
    assert rows_increasing(m) == (n - 1, n - 1)
    m[4, 2] = m[4, 3] + 0.5  # one step goes down by 0.5
    assert rows_increasing(m) == (n - 2, n - 1)
    v = row_step_violations(m, np.full((n, n), 0.1))
    assert v["non_positive_steps"] == 1
    assert v["worst_in_se"] == pytest.approx(0.5 / np.sqrt(0.02))
