"""Kim et al.'s Appendix A.2 row on g'(i) against the Gram flow: both readings' statistics recomputed from the exact
hidden-state Grams of the parameter-free stack without the residual (no formula of the paper), to float64 rounding
(1e-9: a few hundred roundings of numbers of order 1, then a ratio of standard deviations)."""

import numpy as np
import pytest

from poslens.report.sections.closed_forms import ALPHAS, FLAT, N, gprime_weak_claim
from poslens.stack.config import StackConfig
from poslens.stack.gramflow import gram_flow


def _cv(x):
    return np.std(x) / abs(np.mean(x))


def test_gprime_rows_statistics_equal_the_gram_flow_and_read_the_two_readings_apart():
    off, diag = {}, {}
    for a in ALPHAS:
        gram = gram_flow(StackConfig(n=N, alpha=float(a), layers=2, residual=False)).gram[1]
        off[a] = gram[1:, 0]  # <x_i, x_1> for i = 2..n: g'(i), the same for every j < i
        diag[a] = np.diag(gram)[1:]  # h'(i)^2, i = 2..n
        assert np.allclose(gram[2:, 1], off[a][1:], atol=1e-12)  # independent of j
    row = gprime_weak_claim()
    relative = max(_cv(off[a]) / _cv(diag[a]) for a in ALPHAS)
    alone = max(_cv(off[a]) for a in ALPHAS)
    (t1,), (t2,) = (r.tests for r in row.readings)
    assert t1.value == pytest.approx(relative, abs=1e-9) and t2.value == pytest.approx(alone, abs=1e-9)
    assert t1.outcome() == ("pass" if relative < 1 else "fail") and t2.outcome() == ("pass" if alone < FLAT else "fail")
    assert row.verdict == "ambiguous"  # g' varies less than the diagonal, but 0.91 of its mean at alpha = 0
