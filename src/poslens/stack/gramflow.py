"""Gram flow: the exact d -> infinity limit of the parameter-free stack (derivation in docs/gramflow.md).

A parameter-free layer sees its input X only through the Gram matrix G = X X^T. As d grows, the Gram of
the Gaussian-built inputs concentrates to G0 = (1 - alpha) I + alpha 11^T, every hidden state becomes
X^(l) = P^(l) X^(0) with a deterministic n x n matrix P^(l), and one layer maps Gram to Gram:

    N = diag(G)^(-1/2)                                 normalisation (LayerNorm's centring vanishes)
    S = beta (N G N) o C,  beta = row_norm^2 / s       scores; C_ij = c(i - j) RoPE kernel, all ones for NoPE
    A = softmax(mask(S))                               row-wise over visible keys
    M = gamma A N (+ I with residual), gamma = row_norm
    G' = M G M^T

Float64 numpy throughout; no sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from poslens.errors import UsageError, check_int, check_memory, require
from poslens.stack import rope
from poslens.stack.config import StackConfig, visible


@dataclass
class GramFlowResult:
    """Deterministic maps of the d -> infinity stack; scores[0] / probs[0] are layer 1, gram[0] the input."""

    config: StackConfig
    scores: np.ndarray  # [L, n, n] pre-softmax scores, NaN where the mask hides the pair
    probs: np.ndarray  # [L, n, n] attention probabilities, 0 where hidden
    gram: np.ndarray  # [L+1, n, n] Gram matrices of X^(0..L)
    cosine: np.ndarray  # [L+1, n, n] cosine similarity of hidden states


def initial_gram(n: int, alpha: float) -> np.ndarray:
    """G0 = (1 - alpha) I + alpha 11^T: unit-norm inputs with pairwise inner product alpha (paper Eq. 2)."""
    return (1.0 - alpha) * np.eye(n) + alpha * np.ones((n, n))


def position_kernel(config: StackConfig) -> np.ndarray:
    """C in S = beta (N G N) o C: the RoPE kernel c(i - j) at the config's d, or all ones for NoPE."""
    n = config.n
    if config.positional == "rope":
        # c(delta) = mean_m cos(theta_m delta) for the 2n - 1 offsets only (rope.kernel's [n, n, d/2] table would
        # cost n^2 d memory); the same arithmetic per entry, so equal to rope.kernel bit for bit.
        delta = np.arange(-(n - 1), n)
        c = np.cos(delta[:, None] * rope.inv_freq(config.d, config.rope_theta, config.rope_scaling)).mean(-1)
        return c[np.arange(n)[:, None] - np.arange(n)[None, :] + n - 1]
    return np.ones((n, n))


def _softmax(s: np.ndarray, vis: np.ndarray) -> np.ndarray:
    z = np.where(vis, s, -np.inf)
    z = np.exp(z - z.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


def memory_estimate(config: StackConfig) -> int:
    """Bytes `gram_flow` allocates: the four [L(+1), n, n] float64 results plus about ten n x n temporaries;
    with RoPE, the kernel's [2n - 1, d/2] table of angles and its cosines (`position_kernel`)."""
    n, layers = config.n, config.layers
    kernel = 2 * 8 * (2 * n - 1) * (config.d // 2) if config.positional == "rope" else 0
    return 8 * n * n * (4 * layers + 2 + 10) + n * n + kernel


def gram_flow(config: StackConfig, g0: np.ndarray | None = None) -> GramFlowResult:
    """Run the Gram recursion G' = M G M^T for config.layers layers (docs/gramflow.md).

    g0: the input Gram matrix [n, n]; default `initial_gram(n, alpha)` (unit-norm inputs, as the paper).
    A config whose maps cannot fit in memory is refused before any work (`memory_estimate`).
    """
    if not isinstance(config, StackConfig):
        raise UsageError(f"config must be a StackConfig, got {type(config).__name__}")
    n, layers = config.n, config.layers
    check_memory(memory_estimate(config), f"gramflow (n={n}, d={config.d}, layers={layers})",
                 "lower n, layers or (with RoPE) d")
    if g0 is None:
        g = initial_gram(n, config.alpha)
    else:
        try:
            g = np.array(g0, dtype=np.float64)
        except (TypeError, ValueError):
            raise UsageError(f"g0 must be an ({n}, {n}) array of numbers") from None
    require(g.shape == (n, n), f"g0 must have shape ({n}, {n}), got {g.shape}")
    require(bool(np.all(np.isfinite(g))), "g0 must be finite (no NaN or infinity)")
    require(bool(np.all(np.diag(g) > 0)), "g0 must have a positive diagonal (no zero-norm inputs)")
    vis = visible(n, config.mask, config.window)
    c = position_kernel(config)
    beta = config.row_norm**2 / config.score_divisor
    gamma = config.row_norm

    scores = np.empty((layers, n, n))
    probs = np.empty((layers, n, n))
    grams = np.empty((layers + 1, n, n))
    cosine = np.empty((layers + 1, n, n))
    grams[0] = g
    for layer in range(layers):
        inv = 1.0 / np.sqrt(np.diag(g))
        cos = g * inv[:, None] * inv[None, :]  # N G N
        cosine[layer] = cos
        s = beta * cos * c  # scores = beta (N G N) o C
        a = _softmax(s, vis)
        m = gamma * a * inv[None, :]  # gamma A N
        if config.residual:
            m = m + np.eye(n)
        g = m @ g @ m.T  # G' = M G M^T
        g = 0.5 * (g + g.T)  # exact symmetry, so rounding cannot make cosine[i, j] != cosine[j, i]
        scores[layer] = np.where(vis, s, np.nan)
        probs[layer] = a
        grams[layer + 1] = g
    inv = 1.0 / np.sqrt(np.diag(g))
    cosine[layers] = g * inv[:, None] * inv[None, :]
    return GramFlowResult(config=config, scores=scores, probs=probs, gram=grams, cosine=cosine)


def convergence(config: StackConfig, ds, samples: int, seed: int = 0, chunk: int | None = None,
                mc=None, flow=None) -> dict:
    """Monte Carlo (poslens.stack.simulate) against the Gram flow as d grows, for a convergence figure.

    For each d, runs both on `replace(config, d=d)` (the RoPE kernel is the one at that d) and returns
    d [D], max_dev [D, L] (max |MC mean - Gram flow| of the scores over visible pairs, per layer),
    max_se [D, L] (the largest Monte Carlo standard error of those scores), probs_dev [D, L] and
    cosine_dev [D, L+1] (max deviations of the attention probabilities and hidden-state cosines) and samples.
    `mc(config)` and `flow(config)` replace the runs (e.g. cached ones): `mc` returns the "scores_mean",
    "scores_se", "probs_mean" and "cosine_mean" maps, `flow` a GramFlowResult.
    """
    from poslens.stack.simulate import simulate  # torch-backed; imported only when needed

    samples = check_int("samples", samples, 2)
    try:
        ds = [check_int("d", d, 1) for d in ds]
    except TypeError:
        raise UsageError(f"ds must be a list of hidden sizes, got {ds!r}") from None
    require(len(ds) > 0, "ds must list at least one hidden size d")
    vis = visible(config.n, config.mask, config.window)
    max_dev, max_se, probs_dev, cos_dev = [], [], [], []
    for d in ds:
        cfg = replace(config, d=d)
        exact = (flow or gram_flow)(cfg)
        if mc is None:
            r = simulate(cfg, samples, seed=seed, chunk=chunk)
            maps = {k: getattr(r, k) for k in ("scores_mean", "scores_se", "probs_mean", "cosine_mean")}
        else:
            maps = mc(cfg)
        m = {k: maps[k].double().cpu().numpy() for k in ("scores_mean", "scores_se", "probs_mean", "cosine_mean")}
        max_dev.append(np.abs(m["scores_mean"] - exact.scores)[:, vis].max(axis=-1))
        max_se.append(m["scores_se"][:, vis].max(axis=-1))
        probs_dev.append(np.abs(m["probs_mean"] - exact.probs).reshape(cfg.layers, -1).max(axis=-1))
        cos_dev.append(np.abs(m["cosine_mean"] - exact.cosine).reshape(cfg.layers + 1, -1).max(axis=-1))
    return {"d": np.array(ds), "max_dev": np.array(max_dev), "max_se": np.array(max_se),
            "probs_dev": np.array(probs_dev), "cosine_dev": np.array(cos_dev), "samples": samples}
