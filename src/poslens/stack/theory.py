"""Closed forms of the paper (Section 3.2, Appendix A) for the second layer of the parameter-free stack.

Setting (paper Eq. 1-2): l2 norm, causal mask, NoPE, n unit input vectors with <x_i, x_j> = alpha (i != j).
Positions i, j are 1-based as in the paper; arrays returned by `layer2_scores` use 0-based indices.

Layer 1 puts weight e on the diagonal and e^alpha on each earlier key, so row i has the softmax
denominator D(i) = e + (i-1) e^alpha and
    x_i' = (a(i) x_i + e^alpha sum_{k<i} x_k) / D(i),   a(i) = 2e + (i-1) e^alpha  (residual)
                                                          a(i) = e                 (no residual).
Everything below follows from expanding <x_i', x_j'> with sum_{k<i} <x_k, x_j> = 1 + (i-2) alpha (j < i).

Errata found while checking the paper against exact computation (the conclusions still hold):
* Appendix A.2 writes f(X) = Softmax(Causal(YY^T) Y); the intended layer is Softmax(Causal(YY^T)) Y.
* Appendix A.1's polynomial for h(j+1)^2 - h(j)^2 has wrong j and constant coefficients, and A.2's
  h'(i+1)^2 - h'(i)^2 has a sign slip (-2e^(2+alpha)(i-1) should be +). The corrected numerators are in
  `h_sq_step`; every coefficient is negative for 0 <= alpha < 1, so h and h' are strictly decreasing.
"""

from __future__ import annotations

import math

import numpy as np

from poslens.errors import check_float, check_int, require
from poslens.maps import rows_increasing  # noqa: F401  (re-exported: the Section 3 check)

E = math.e


def _positions(i) -> np.ndarray:
    i = np.asarray(i, dtype=np.float64)
    require(bool(np.all(i >= 1)), "positions i are 1-based: every i must be >= 1")
    return i


def _alpha(alpha: float) -> float:
    return check_float("alpha", alpha, 0.0, 1.0, hi_open=True)


def _denom(i: np.ndarray, alpha: float) -> np.ndarray:
    """D(i) = e + (i-1) e^alpha, the layer-1 softmax denominator of query i."""
    return E + (i - 1) * math.exp(alpha)


def g(i, alpha: float) -> np.ndarray:
    """<x_i^(1), x_j^(1)> for i > j with residual (Sec. 3.2, above Eq. 3); independent of j."""
    i, alpha = _positions(i), _alpha(alpha)
    ea = math.exp(alpha)
    return 2 * (2 * alpha * E + ea * (1 + alpha * (2 * i - 3))) / _denom(i, alpha)


def h(i, alpha: float) -> np.ndarray:
    """||x_i^(1)|| with residual (Eq. 3)."""
    i, alpha = _positions(i), _alpha(alpha)
    ea = math.exp(alpha)
    a = 2 * E + (i - 1) * ea
    num = a**2 + 2 * a * ea * alpha * (i - 1) + ea**2 * (i - 1) * (1 + (i - 2) * alpha)  # Eq. 3
    return np.sqrt(num) / _denom(i, alpha)


def g_prime(i, alpha: float) -> np.ndarray:
    """<x_i^(1), x_j^(1)> for i > j without residual (Appendix A.2); independent of j (checked exactly)."""
    i, alpha = _positions(i), _alpha(alpha)
    ea = math.exp(alpha)
    return (E * alpha + ea * (1 + alpha * (i - 2))) / _denom(i, alpha)


def h_prime(i, alpha: float) -> np.ndarray:
    """||x_i^(1)|| without residual (Appendix A.2)."""
    i, alpha = _positions(i), _alpha(alpha)
    ea = math.exp(alpha)
    num = E**2 + 2 * E * ea * alpha * (i - 1) + ea**2 * (i - 1) * (1 + alpha * (i - 2))  # A.2
    return np.sqrt(num) / _denom(i, alpha)


def layer2_scores(n: int, alpha: float, residual: bool = True) -> np.ndarray:
    """Layer-2 pre-softmax scores <y_i^(2), y_j^(2)> = g(i) / (h(i) h(j)) (Eq. 4), shape [n, n].

    Row = query, column = key (0-based). Diagonal 1, strict upper triangle NaN (hidden by the mask).
    residual=False uses g', h' of Appendix A.2.
    """
    n = check_int("n", n, 1)
    p = np.arange(1, n + 1, dtype=np.float64)
    gi, hi = (g(p, alpha), h(p, alpha)) if residual else (g_prime(p, alpha), h_prime(p, alpha))
    s = gi[:, None] / (hi[:, None] * hi[None, :])  # Eq. 4, valid for i > j
    s[np.diag_indices(n)] = 1.0
    s[np.triu_indices(n, 1)] = np.nan
    return s


def h_sq_step(i, alpha: float, residual: bool = True) -> np.ndarray:
    """h(i+1)^2 - h(i)^2 in closed form (corrected Appendix A.1; with residual=False, corrected A.2 for h').

    Numerators over (e + i b)^2 (e + (i-1) b)^2, with b = e^alpha:
      residual:    (alpha-1)(b^4 + 2e b^3) i^2 + (1-alpha)(b^4 + 2e b^3 - 6e^2 b^2) i + 4(1-alpha) e^2 b (b-e)
      no residual: (alpha-1) b (2e^3 + 2e^2 b (i-1) + b^3 i (i-1))
    """
    i, alpha = _positions(i), _alpha(alpha)
    b = math.exp(alpha)
    den = (E + i * b) ** 2 * (E + (i - 1) * b) ** 2
    if residual:
        c2 = (alpha - 1) * (b**4 + 2 * E * b**3)
        c1 = (1 - alpha) * (b**4 + 2 * E * b**3 - 6 * E**2 * b**2)
        c0 = 4 * (1 - alpha) * E**2 * b * (b - E)
        return (c2 * i**2 + c1 * i + c0) / den
    return (alpha - 1) * b * (2 * E**3 + 2 * E**2 * b * (i - 1) + b**3 * i * (i - 1)) / den


def h_strictly_decreasing(n: int, alpha: float, residual: bool = True) -> bool:
    """The paper's claim (Appendix A.1 / A.2): h(1) > h(2) > ... > h(n) (h' when residual=False)."""
    n = check_int("n", n, 1)
    p = np.arange(1, n + 1, dtype=np.float64)
    vals = h(p, alpha) if residual else h_prime(p, alpha)
    return bool(np.all(np.diff(vals) < 0))

