"""Closed forms of Section 3.2 / Appendix A against an exact finite construction of paper Eq. 1.

The construction: rows of the Cholesky factor of (1 - alpha) I + alpha 11^T are n unit vectors whose pairwise
inner products are exactly alpha, so one numerical layer computes the closed forms' quantities with only
float64 rounding. Tolerance 1e-12: O(n) sums of O(1) terms at machine epsilon ~1e-16.
"""

import math

import numpy as np
import pytest

from poslens.errors import UsageError
from poslens.stack import theory

ALPHAS = [0.0, 0.1, 0.2, 0.5, 0.9]
TOL = 1e-12


def exact_inputs(n: int, alpha: float) -> np.ndarray:
    x = np.linalg.cholesky((1 - alpha) * np.eye(n) + alpha * np.ones((n, n)))
    assert np.allclose(x @ x.T, (1 - alpha) * np.eye(n) + alpha, atol=1e-14)
    return x


def layer(x: np.ndarray, residual: bool) -> np.ndarray:
    """Paper Eq. 1: softmax(Causal(Y Y^T)) Y (+ X), Y = L2Norm(X)."""
    y = x / np.linalg.norm(x, axis=1, keepdims=True)
    s = y @ y.T
    s[np.triu_indices(len(x), 1)] = -np.inf
    a = np.exp(s - s.max(1, keepdims=True))
    a /= a.sum(1, keepdims=True)
    return a @ y + x if residual else a @ y


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("residual", [True, False])
def test_g_h_match_exact_layer(alpha, residual):
    n = 24
    x1 = layer(exact_inputs(n, alpha), residual)
    gram = x1 @ x1.T
    p = np.arange(1, n + 1)
    gfun, hfun = (theory.g, theory.h) if residual else (theory.g_prime, theory.h_prime)
    np.testing.assert_allclose(np.sqrt(np.diag(gram)), hfun(p, alpha), rtol=0, atol=TOL)
    # off-diagonal i > j: depends on the query i only (the closed forms' claim), equal to g(i) / g'(i)
    lower = np.tril(np.ones((n, n), dtype=bool), -1)
    expected = np.broadcast_to(gfun(p, alpha)[:, None], (n, n))
    np.testing.assert_allclose(gram[lower], expected[lower], rtol=0, atol=TOL)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("residual", [True, False])
def test_layer2_scores_match_exact_two_layers(alpha, residual):
    n = 24
    y2 = layer(exact_inputs(n, alpha), residual)
    y2 /= np.linalg.norm(y2, axis=1, keepdims=True)
    exact = y2 @ y2.T
    s = theory.layer2_scores(n, alpha, residual)
    lower = np.tril(np.ones((n, n), dtype=bool))
    np.testing.assert_allclose(s[lower], exact[lower], rtol=0, atol=TOL)
    assert np.all(np.isnan(s[~lower]))
    assert np.all(np.diag(s) == 1.0)


def test_paper_g_formula_at_small_i():
    # hand checks: g(2, 0) = 2 (0 + e^0 (1 + 0)) / (e + e^0); query 1 attends only to itself
    assert theory.g(2, 0.0) == pytest.approx(2 / (math.e + 1), abs=1e-15)
    assert theory.h(1, 0.3) == pytest.approx(2.0, abs=1e-15)  # x_1' = 2 x_1 (attends only to itself)
    assert theory.h_prime(1, 0.3) == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("residual", [True, False])
def test_h_sq_step_closed_form(alpha, residual):
    # corrected Appendix A.1 / A.2 polynomials equal the direct difference of the closed forms
    i = np.arange(1, 200, dtype=np.float64)
    hfun = theory.h if residual else theory.h_prime
    direct = hfun(i + 1, alpha) ** 2 - hfun(i, alpha) ** 2
    np.testing.assert_allclose(theory.h_sq_step(i, alpha, residual), direct, rtol=1e-9, atol=1e-15)
    assert np.all(theory.h_sq_step(i, alpha, residual) < 0)


def test_paper_appendix_polynomials_are_wrong():
    # A.1 as printed: not equal to h(j+1)^2 - h(j)^2 (about twice it at j = 1..5), though still negative.
    e = math.e
    j = np.arange(1, 6, dtype=np.float64)
    for a in (0.0, 0.2):
        ea = math.exp(a)
        den = (e + j * ea) ** 2 * (e + (j - 1) * ea) ** 2
        c2 = (a - 1) * math.exp(4 * a) + 2 * (a - 1) * math.exp(3 * a + 1)
        c1 = (2 * a - 6) * math.exp(a + 3) + 2 * (a - 1) * math.exp(3 * a + 1) + (a - 1) * math.exp(4 * a)
        c0 = (2 * a - 4) * math.exp(a + 3) + (-2 * a + 4) * math.exp(2 * a + 2)
        printed = (c2 * j**2 + c1 * j + c0) / den
        direct = theory.h(j + 1, a) ** 2 - theory.h(j, a) ** 2
        assert np.all(np.abs(printed - direct) > 0.1 * np.abs(direct))
    # A.2 as printed: (alpha-1) e^a (2e^3 - 2e^(2+a)(i-1) + e^(3a) i(i-1)) / den. It would be positive at
    # alpha = 0, i = 6..8 although h' is decreasing there; the corrected form has + 2e^(2+a)(i-1).
    e, a = math.e, 0.0
    i = np.arange(1, 12, dtype=np.float64)
    b = math.exp(a)
    den = (e + i * b) ** 2 * (e + (i - 1) * b) ** 2
    printed = (a - 1) * b * (2 * e**3 - 2 * e**2 * b * (i - 1) + b**3 * i * (i - 1)) / den
    assert np.any(printed > 0)
    assert np.all(theory.h_sq_step(i, a, residual=False) < 0)


@pytest.mark.parametrize("n", [2, 5, 50, 1000])
@pytest.mark.parametrize("alpha", [0.0, 0.05, 0.2, 0.5, 0.8, 0.99])
@pytest.mark.parametrize("residual", [True, False])
def test_claims_hold(n, alpha, residual):
    assert theory.h_strictly_decreasing(n, alpha, residual)
    assert theory.rows_increasing(theory.layer2_scores(n, alpha, residual)) == (n - 1, n - 1)


def test_rows_increasing_counts_and_nan():
    s = np.full((4, 4), np.nan)
    s[np.tril_indices(4)] = 0.0
    s[1, :2] = [0.1, 1.0]  # increasing
    s[2, :3] = [0.3, 0.2, 1.0]  # not
    s[3, :4] = [np.nan, 0.1, 0.5, 1.0]  # hidden key ignored (sliding window): increasing
    assert theory.rows_increasing(s) == (2, 3)
    s[3, :3] = np.nan  # one finite entry: not checked
    assert theory.rows_increasing(s) == (1, 2)


def test_bad_input():
    with pytest.raises(UsageError, match="alpha"):
        theory.g(3, 1.0)
    with pytest.raises(UsageError, match="1-based"):
        theory.h(0, 0.1)
    with pytest.raises(UsageError, match="n"):
        theory.layer2_scores(0, 0.1)
    with pytest.raises(UsageError, match="square"):
        theory.rows_increasing(np.zeros((2, 3)))
