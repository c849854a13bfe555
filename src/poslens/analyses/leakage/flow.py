"""The decomposition of leakage in the parameter-free stack (paper Eq. 1), for three architectures.

Standard RoPE, NTK-scaled RoPE (a larger base) and sliding-window attention, each as a `StackConfig`. Two ways:

* Monte Carlo (`monte_carlo`): the stack run on random inputs drawn exactly as `poslens.stack.simulate` draws
  them (`draw_inputs`, block-seeded), in float64, keeping per layer the sums of the scores s_ij and of the
  log-partition l_i = log sum_{j seen by i} exp s_ij (and the lag profile's log-partition L0_i,
  `causal.lag_log_partition`) for G groups of blocks, so every share gets a jackknife interval
  (`poslens.engine.stats.GroupedSums`). `position_offset` runs every position shifted by a constant.
* The infinite-width limit (`exact_split`): as d -> infinity the scores of the Gram flow
  (`poslens.stack.gramflow`, docs/gramflow.md) are deterministic, so the log-partition is exactly the
  logsumexp of the Gram-flow scores over the visible keys and the decomposition (metrics.attention_split) is
  exact: with one deterministic map per layer the per-sequence two-way fit is that of the map.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch

from poslens.analyses.leakage.causal import lag_log_partition
from poslens.analyses.leakage.metrics import Domain, Moments, attention_split
from poslens.engine.stats import GroupedSums
from poslens.errors import check_choice, check_float, check_int
from poslens.stack.config import StackConfig, visible
from poslens.stack.gramflow import gram_flow
from poslens.stack.rope import cos_sin, rotate
from poslens.stack.simulate import BLOCK, draw_inputs, l2_normalize, layer_norm

ARCHITECTURES = ("standard", "ntk", "sliding")
# e_total = ||P log A||^2, scores_energy = ||P S||^2 (a description of the scores); with a causal mask also the
# decomposition (metrics.attention_split)
SPLIT_KEYS = ("e_total", "scores_energy", "mask_only", "residual", "cross", "share_mask_only", "share_residual",
              "share_cross")


def architecture(name: str, base: StackConfig, ntk_scaling: float = 8.0, window: int | None = None) -> StackConfig:
    """`base` as standard RoPE, NTK-scaled RoPE (base theta * s^(d/(d-2)), s = ntk_scaling) or RoPE with a
    sliding window (default n // 4 keys, self included)."""
    check_choice("architecture", name, ARCHITECTURES)
    rope = replace(base, positional="rope", mask="causal", window=None, rope_scaling=1.0)
    if name == "ntk":
        return replace(rope, rope_scaling=check_float("ntk_scaling", ntk_scaling, 1.0, math.inf, hi_open=True))
    if name == "sliding":
        return replace(rope, mask="sliding", window=window or max(2, base.n // 4))
    return rope


def log_partition(scores: np.ndarray | torch.Tensor, vis: np.ndarray) -> torch.Tensor:
    """l_i = log sum over the visible keys j of exp s_ij, for scores [..., n, n] and a visibility mask [n, n]."""
    s = torch.as_tensor(np.asarray(scores), dtype=torch.float64)
    return torch.logsumexp(s.masked_fill(~torch.as_tensor(vis), -math.inf), -1)


def exact_split(config: StackConfig, domain: Domain | None = None) -> dict[str, torch.Tensor]:
    """The decomposition per layer ([L] tensors, SPLIT_KEYS) in the d -> infinity limit."""
    domain = domain or Domain(window=config.window)
    flow = gram_flow(config)
    vis = visible(config.n, config.mask, config.window)
    hidden = ~torch.as_tensor(vis)
    scores = torch.as_tensor(flow.scores, dtype=torch.float64)
    relative = None if config.mask == "none" else lag_log_partition(scores.masked_fill(hidden, -math.inf))
    return both_splits(scores.masked_fill(hidden, math.nan), log_partition(scores, vis), relative, domain)


def both_splits(scores: torch.Tensor, log_partition: torch.Tensor, relative: torch.Tensor | None,
                domain: Domain) -> dict[str, torch.Tensor]:
    """e_total = ||P log A||^2 and scores_energy = ||P S||^2 and, with a causal mask (`relative`: the lag profile's
    log-partition L0 given), metrics.attention_split."""
    mo = Moments.of(scores, domain)
    out = {"e_total": mo.minus_rows(log_partition).residual(), "scores_energy": mo.residual()}
    if relative is not None:
        out.update(attention_split(scores, log_partition, relative, domain))
    return out


def _forward(config: StackConfig, x: torch.Tensor, cos, sin, vis: torch.Tensor):
    """Scores [L, B, n, n], log-partitions and counterfactual log-partitions [L, B, n] of the stack on inputs
    x [B, n, d] (float64)."""
    scores, parts, relative = [], [], []
    y, norm = torch.empty_like(x), torch.empty(*x.shape[:-1], 1, dtype=x.dtype)
    for _ in range(config.layers):
        (l2_normalize if config.norm == "l2" else layer_norm)(x, y, norm)  # Y = Norm(X)
        q = rotate(y, cos, sin) if config.positional == "rope" else y
        s = q @ q.mT / config.score_divisor  # S = R(Y) R(Y)^T / s (Eq. 1)
        z = s.masked_fill(~vis, -math.inf)
        lse = torch.logsumexp(z, -1)
        a = torch.exp(z - lse[..., None])  # A = softmax(mask(S))
        x = a @ y + x if config.residual else a @ y  # X' = A Y (+ X)
        scores.append(s)
        parts.append(lse)
        if config.mask != "none":  # the counterfactual needs a causal mask
            relative.append(lag_log_partition(z))
    return torch.stack(scores), torch.stack(parts), torch.stack(relative) if relative else None


def monte_carlo(config: StackConfig, samples: int, groups: int = 10, seed: int = 0,
                position_offset: int = 0) -> GroupedSums:
    """Sums of the scores ("scores" [L, n, n]), log-partitions ("log_partition" [L, n]) and counterfactual
    log-partitions ("lag_log_partition" [L, n]) over `samples` inputs, block b of BLOCK samples into group
    b mod `groups`. Positions run from `position_offset`."""
    samples = check_int("samples", samples, 1)
    check_int("position_offset", position_offset, 0)
    n = config.n
    vis = torch.as_tensor(visible(n, config.mask, config.window))
    cos = sin = None
    if config.positional == "rope":
        cos, sin = cos_sin(n + position_offset, config.d, config.rope_theta, config.rope_scaling, torch.float64)
        cos, sin = cos[position_offset:], sin[position_offset:]
    sums = GroupedSums(groups)
    for block in range(-(-samples // BLOCK)):
        size = min(BLOCK, samples - block * BLOCK)
        x = draw_inputs(config, seed, block, size, dtype=torch.float64)
        s, lse, rel = _forward(config, x, cos, sin, vis)
        sums.add("scores", block, s.sum(1), size)
        sums.add("log_partition", block, lse.sum(1), size)
        if rel is not None:
            sums.add("lag_log_partition", block, rel.sum(1), size)
    return sums


def mc_split(config: StackConfig, samples: int, domain: Domain | None = None, groups: int = 10, seed: int = 0,
             level: float = 0.95, position_offset: int = 0) -> dict[str, dict[str, torch.Tensor]]:
    """The decomposition per layer from the Monte Carlo means, each key with its jackknife interval over the groups:
    {key: {"value", "lo", "hi", "se"}} with [L] tensors."""
    domain = domain or Domain(window=config.window)
    sums = monte_carlo(config, samples, groups, seed, position_offset)

    keys = [k for k in SPLIT_KEYS if "lag_log_partition" in sums or k in ("e_total", "scores_energy")]

    def stacked(m: dict) -> torch.Tensor:
        parts = both_splits(m["scores"], m["log_partition"], m.get("lag_log_partition"), domain)
        return torch.stack([parts[k] for k in keys])

    est = sums.estimate(stacked, level=level)  # one jackknife for every key
    return {k: {p: getattr(est, p)[i] for p in ("value", "lo", "hi", "se")} for i, k in enumerate(keys)}


def compare(base: StackConfig, samples: int = 0, domain: Domain | None = None, ntk_scaling: float = 8.0,
            window: int | None = None, groups: int = 10, seed: int = 0) -> dict[str, dict]:
    """Per architecture: its config, the exact decomposition (Gram flow) and, with samples > 0, the Monte Carlo
    one."""
    out = {}
    for name in ARCHITECTURES:
        cfg = architecture(name, base, ntk_scaling, window)
        dom = domain if domain is not None else Domain(window=cfg.window)
        if cfg.window is not None and dom.window is None:
            dom = replace(dom, window=cfg.window)
        entry = {"config": cfg.to_dict(), "exact": exact_split(cfg, dom)}
        if samples:
            entry["monte_carlo"] = mc_split(cfg, samples, dom, groups, seed)
        out[name] = entry
    return out
