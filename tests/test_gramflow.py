"""Gram flow: exact agreement with the closed forms and with explicit finite stacks, and its symmetries.

Tolerances: 1e-12 for exact identities (float64 rounding through a few n x n products and exps);
relative 1e-12 where Gram entries grow with depth.
"""

from dataclasses import replace

import numpy as np
import pytest

from poslens.errors import UsageError
from poslens.stack import theory
from poslens.stack.config import StackConfig, visible
from poslens.stack.gramflow import gram_flow, initial_gram, position_kernel

TOL = 1e-12


def explicit_stack(x: np.ndarray, cfg: StackConfig) -> list[np.ndarray]:
    """NoPE stack on explicit vectors x [n, d] (paper Eq. 1, with the stack's norm, mask and residual).

    Returns the pre-softmax score map of every layer (NaN where hidden). LayerNorm is the real one
    (centre, divide by the biased std), so it agrees with the Gram flow only for rows orthogonal to 1.
    """
    vis = visible(cfg.n, cfg.mask, cfg.window)
    out = []
    for _ in range(cfg.layers):
        if cfg.norm == "l2":
            y = x / np.linalg.norm(x, axis=1, keepdims=True)
        else:
            c = x - x.mean(axis=1, keepdims=True)
            y = c / c.std(axis=1, keepdims=True)
        s = y @ y.T / cfg.score_divisor
        z = np.where(vis, s, -np.inf)
        a = np.exp(z - z.max(1, keepdims=True))
        a /= a.sum(1, keepdims=True)
        x = a @ y + x if cfg.residual else a @ y
        out.append(np.where(vis, s, np.nan))
    return out


def exact_inputs(n: int, d: int, alpha: float) -> np.ndarray:
    """n unit rows in R^d (d > n), Gram exactly G0, every row orthogonal to the all-ones vector of R^d."""
    q, _ = np.linalg.qr(np.concatenate([np.ones((d, 1)), np.random.default_rng(0).normal(size=(d, n))], axis=1))
    return np.linalg.cholesky(initial_gram(n, alpha)) @ q[:, 1:].T  # columns 1.. are orthogonal to 1


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 0.9])
@pytest.mark.parametrize("residual", [True, False])
def test_layer2_equals_closed_form(alpha, residual):
    cfg = StackConfig(n=40, alpha=alpha, layers=2, residual=residual)
    s = gram_flow(cfg).scores[1]
    ref = theory.layer2_scores(40, alpha, residual)
    np.testing.assert_array_equal(np.isnan(s), np.isnan(ref))
    np.testing.assert_allclose(s[~np.isnan(s)], ref[~np.isnan(ref)], rtol=0, atol=TOL)


@pytest.mark.parametrize("norm", ["l2", "layernorm-sqrt-d", "layernorm-d"])
@pytest.mark.parametrize("mask,window", [("causal", None), ("none", None), ("sliding", 4)])
@pytest.mark.parametrize("residual", [True, False])
def test_every_layer_equals_explicit_stack(norm, mask, window, residual):
    # A NoPE layer sees only the Gram matrix, so inputs with Gram exactly G0 make the flow exact at any d.
    cfg = StackConfig(n=12, d=13, alpha=0.3, layers=4, norm=norm, mask=mask, window=window, residual=residual)
    flow = gram_flow(cfg)
    for got, ref in zip(flow.scores, explicit_stack(exact_inputs(12, 13, 0.3), cfg)):
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        scale = max(1.0, np.nanmax(np.abs(ref)))
        np.testing.assert_allclose(got[~np.isnan(got)], ref[~np.isnan(ref)], rtol=0, atol=TOL * scale)


def test_result_shapes_and_consistency():
    cfg = StackConfig(n=10, layers=3, alpha=0.2, positional="rope", mask="sliding", window=3)
    f = gram_flow(cfg)
    assert f.scores.shape == f.probs.shape == (3, 10, 10)
    assert f.gram.shape == f.cosine.shape == (4, 10, 10)
    vis = visible(10, "sliding", 3)
    assert np.all(np.isnan(f.scores[:, ~vis])) and np.all(np.isfinite(f.scores[:, vis]))
    assert np.all(f.probs[:, ~vis] == 0)
    np.testing.assert_allclose(f.probs.sum(-1), 1.0, rtol=0, atol=TOL)
    np.testing.assert_allclose(f.gram[0], initial_gram(10, 0.2), rtol=0, atol=0)
    np.testing.assert_allclose(np.diagonal(f.cosine, axis1=1, axis2=2), 1.0, rtol=0, atol=TOL)
    # l2 scores are cosines times the RoPE kernel (beta = 1)
    np.testing.assert_allclose(f.scores[:, vis], (f.cosine[:-1] * position_kernel(cfg))[:, vis], rtol=0, atol=TOL)


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.6])
def test_unmasked_nope_is_position_independent(alpha):
    f = gram_flow(StackConfig(n=20, alpha=alpha, layers=4, mask="none"))
    off = ~np.eye(20, dtype=bool)
    for s in f.scores:
        assert np.ptp(s[off]) < TOL and np.ptp(np.diag(s)) < TOL


def _band_spread(s: np.ndarray) -> float:
    """Largest max - min along any diagonal (0 for an exactly Toeplitz, i.e. relative, map)."""
    n = s.shape[0]
    bands = [np.diagonal(s, k) for k in range(-n + 1, n)]
    return max(float(np.ptp(b[np.isfinite(b)])) for b in bands if np.isfinite(b).any())


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5])
def test_rope_unmasked_relative_causal_not(alpha):
    """Section 5.1: without a mask RoPE's maps are relative; the causal mask makes them non-relative.

    Exactly: layer 1 is Toeplitz (S = beta G0 o C), and at alpha = 0 layer 2 too (layer 1 is then the
    identity map up to scale). Later unmasked layers are only nearly Toeplitz: row i's softmax normaliser
    sums c over offsets i-n+1..i, which differ between rows. What stays exact without a mask is the
    reversal symmetry S[i, j] = S[n-1-i, n-1-j], which the causal mask breaks.
    """
    n = 16
    free = gram_flow(StackConfig(n=n, alpha=alpha, layers=4, positional="rope", mask="none"))
    causal = gram_flow(StackConfig(n=n, alpha=alpha, layers=4, positional="rope"))
    assert _band_spread(free.scores[0]) < TOL and _band_spread(causal.scores[0]) < TOL
    if alpha == 0.0:
        assert _band_spread(free.scores[1]) < TOL
    for layer in range(4):
        np.testing.assert_allclose(free.scores[layer], free.scores[layer][::-1, ::-1], rtol=0, atol=TOL)
    for layer in range(1, 4):
        # measured: unmasked spread <= 4e-4, causal >= 0.05 at n=16, d=64
        assert _band_spread(free.scores[layer]) < 1e-3
        assert _band_spread(causal.scores[layer]) > 0.03
        assert _band_spread(causal.scores[layer]) > 50 * _band_spread(free.scores[layer])


@pytest.mark.parametrize("positional", ["none", "rope"])
def test_sliding_window_of_n_is_causal(positional):
    base = StackConfig(n=12, alpha=0.2, layers=3, positional=positional)
    ref = gram_flow(base)
    f = gram_flow(replace(base, mask="sliding", window=12))
    np.testing.assert_array_equal(f.scores, ref.scores)  # same mask, same arithmetic: bit-identical
    np.testing.assert_array_equal(f.gram, ref.gram)
    with pytest.raises(UsageError, match="window must be at most"):  # a window past n means nothing more
        replace(base, mask="sliding", window=13)
    assert not np.array_equal(gram_flow(replace(base, mask="sliding", window=11)).probs, ref.probs)


@pytest.mark.parametrize("positional", ["none", "rope"])
def test_layernorm_d_equals_l2(positional):
    """LayerNorm rows are sqrt(d) times l2 rows and s = d, so scores agree (beta = 1 in both).

    Without residual each layer is scale-invariant, so the stacks agree exactly. With residual, the
    input added back has norm 1 while sqrt(d) A Y has norm ~sqrt(d): they agree only at layer 1, unless
    the inputs are scaled to norm sqrt(d) too (G0 -> d G0), which makes every hidden state sqrt(d) times
    the l2 one.
    """
    d = 64
    l2 = StackConfig(n=12, d=d, alpha=0.2, layers=4, positional=positional)
    ln = replace(l2, norm="layernorm-d")
    a, b = gram_flow(replace(l2, residual=False)), gram_flow(replace(ln, residual=False))
    np.testing.assert_allclose(b.scores, a.scores, rtol=0, atol=TOL)
    np.testing.assert_allclose(b.cosine, a.cosine, rtol=0, atol=TOL)
    a, b = gram_flow(l2), gram_flow(ln, g0=d * initial_gram(12, 0.2))
    np.testing.assert_allclose(b.scores, a.scores, rtol=0, atol=TOL)
    np.testing.assert_allclose(b.probs, a.probs, rtol=0, atol=TOL)
    np.testing.assert_allclose(b.gram, d * a.gram, rtol=TOL, atol=0)
    unit = gram_flow(ln)  # unit-norm inputs: same first layer, different afterwards
    np.testing.assert_allclose(unit.scores[0], a.scores[0], rtol=0, atol=TOL)
    assert np.nanmax(np.abs(unit.scores[1] - a.scores[1])) > 1e-3


@pytest.mark.parametrize("alpha", [0.0, 0.2])
def test_rows_increasing_layers_2_to_4(alpha):
    f = gram_flow(StackConfig(n=16, alpha=alpha, layers=4))
    for layer in (1, 2, 3):
        assert theory.rows_increasing(f.scores[layer]) == (15, 15)


def test_alpha0_later_layers_dip_before_the_diagonal():
    """The paper says layers 3-4 are strictly increasing in j <= i too. In the d -> inf limit at alpha = 0
    this fails for long rows: the off-diagonal scores rise to a maximum at an interior key and then fall
    gently towards j = i-1 (then jump to 1 on the diagonal). The explicit finite stack with orthonormal
    inputs (exact, not a limit) shows the same. At alpha = 0.2 the claim holds.
    """
    cfg = StackConfig(n=50, alpha=0.0, layers=4)
    f = gram_flow(cfg)
    explicit = explicit_stack(np.eye(50), cfg)
    for layer in (2, 3):
        s = f.scores[layer]
        np.testing.assert_allclose(s[np.isfinite(s)], explicit[layer][np.isfinite(s)], rtol=0, atol=TOL)
        holding, checked = theory.rows_increasing(s)
        assert 0 < holding < checked
        for i in range(2, 50):
            steps = np.diff(s[i, : i + 1])  # steps[-1]: j = i-1 -> i (the diagonal, 1)
            assert steps[-1] > 0
            signs = np.sign(steps[:-1])
            assert np.all(np.diff(signs) <= 0)  # off-diagonal part unimodal: up, then (maybe) down
            assert np.max(s[i, :i]) - s[i, i - 1] < 0.01  # measured <= 3.2e-3 at n = 50
    assert theory.rows_increasing(gram_flow(replace(cfg, alpha=0.2)).scores[2]) == (49, 49)


def test_bad_g0():
    with pytest.raises(UsageError, match="g0"):
        gram_flow(StackConfig(n=4), g0=np.eye(3))
    with pytest.raises(UsageError, match="g0"):
        gram_flow(StackConfig(n=2), g0=np.zeros((2, 2)))
