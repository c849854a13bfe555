"""The predecessor's linear Delta R^2 test on synthetic post-RoPE heads (a planted absolute term, and none)."""

import numpy as np
import pytest
import torch

from poslens.analyses.leakage import predecessor as pr
from poslens.errors import UsageError
from poslens.stack.rope import cos_sin, rotate

T, D, SEQS = 48, 16, 12


def head_scores(seed: int, planted: float) -> torch.Tensor:
    """Scores q_i . k_j of one head over SEQS sequences: q_i = R_i (q0 + planted * (i / T) v + noise),
    k_j = R_j (k0 + noise). With planted = 0 the expected score depends on i - j only."""
    g = torch.Generator().manual_seed(seed)
    cos, sin = cos_sin(T, D, 100.0, dtype=torch.float64)
    q0, k0, v = (torch.randn(D, generator=torch.Generator().manual_seed(99 + s), dtype=torch.float64)
                 for s in range(3))
    pos = (torch.arange(T, dtype=torch.float64) / T)[:, None]
    q = q0 + planted * pos * v + 0.5 * torch.randn(SEQS, T, D, generator=g, dtype=torch.float64)
    k = k0 + 0.5 * torch.randn(SEQS, T, D, generator=g, dtype=torch.float64)
    return rotate(q, cos, sin) @ rotate(k, cos, sin).mT


def test_linear_delta_r2_is_zero_in_sample_for_an_exactly_linear_relative_map():
    i = torch.arange(T, dtype=torch.float64)[:, None]
    j = torch.arange(T, dtype=torch.float64)[None, :]
    rel = 0.3 * (i - j)
    assert float(pr.linear_delta_r2(rel, test_fraction=0)) == pytest.approx(0.0, abs=1e-10)
    planted = rel + 0.2 * i + 0.05 * torch.randn(T, T, generator=torch.Generator().manual_seed(0),
                                                 dtype=torch.float64)
    assert float(pr.linear_delta_r2(planted)) > 0.1


def test_delta_r2_matches_numpy_least_squares():
    y = torch.randn(T, T, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    i, j = np.tril_indices(T)
    test = pr.split_pairs(T, 0.3, seed=5).numpy()
    yy = y.numpy()[i, j]

    def r2(cols):
        x = np.stack(cols, 1).astype(float)
        coef = np.linalg.lstsq(x[~test], yy[~test], rcond=None)[0]
        res = yy[test] - x[test] @ coef
        return 1 - np.sum(res**2) / np.sum((yy[test] - yy[test].mean()) ** 2)

    one = np.ones_like(i)
    expected = r2([one, i - j, i, j]) - r2([one, i - j])
    assert float(pr.linear_delta_r2(y, 0.3, seed=5)) == pytest.approx(expected, abs=1e-10)


def test_planted_absolute_head_is_detected_and_relative_heads_are_not():
    """Real vs null with the predecessor's statistics over 31 heads: head 0 has a planted absolute term (its null
    does not), heads 1-30 are relative (real and null from the same law, so the sign-flip test is exact). The
    planted head's interval lies above zero and it survives BH at 0.05; no relative head does, and the share of
    raw p-values under 0.05 among them stays near its nominal 5% (at most 5 of 30: P < 0.002 for Binomial(30, 0.05))."""
    real = [pr.linear_delta_r2(head_scores(0, planted=3.0))]
    null = [pr.linear_delta_r2(head_scores(1000, planted=0.0))]
    for h in range(1, 31):
        real.append(pr.linear_delta_r2(head_scores(h, 0.0)))
        null.append(pr.linear_delta_r2(head_scores(1000 + h, 0.0)))
    res = pr.paired_test(torch.stack(real, 1), torch.stack(null, 1), bootstrap=500, permutations=2000, seed=0)
    assert bool(res.significant[0]) and float(res.lo[0]) > 0
    assert not bool(res.significant[1:].any())
    assert int((res.p[1:] < 0.05).sum()) <= 5


def test_benjamini_hochberg_step_up():
    """A textbook case: m = 5, q = 0.05; thresholds 0.01, 0.02, 0.03, 0.04, 0.05: ranks 1-3 fall under the
    line (0.021 > 0.02 at rank 2 is rescued by 0.029 <= 0.03 at rank 3: step-up)."""
    p = torch.tensor([0.005, 0.021, 0.029, 0.2, 0.8])
    assert pr.benjamini_hochberg(p, 0.05).tolist() == [True, True, True, False, False]
    assert pr.benjamini_hochberg(torch.tensor([0.5, 0.9]), 0.05).tolist() == [False, False]


def test_circular_shift_keeps_bos_and_rotates_the_rest():
    ids = torch.arange(10).reshape(2, 5)
    out = pr.circular_shift(ids, torch.tensor([1, 2]), keep=1)
    assert out.tolist() == [[0, 4, 1, 2, 3], [5, 8, 9, 6, 7]]
    assert sorted(out[1].tolist()) == ids[1].tolist()


def test_bad_input():
    with pytest.raises(UsageError, match="sequences"):
        pr.paired_test(torch.zeros(1, 3), torch.zeros(1, 3))
    with pytest.raises(UsageError, match="same shape"):
        pr.paired_test(torch.zeros(4, 3), torch.zeros(4, 2))
