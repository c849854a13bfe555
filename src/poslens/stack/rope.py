"""Rotary position embedding (RoPE) in the Hugging Face half-split convention, and its mean kernel.

Plane m pairs dimensions (m, m + d/2) and rotates them by the angle p * theta_m at position p, with
theta_m = base^(-2m/d). NTK-style scaling by a factor s replaces base by base * s^(d/(d-2)).
"""

from __future__ import annotations

import numpy as np
import torch


def inv_freq(d: int, theta: float = 10000.0, scaling: float = 1.0) -> np.ndarray:
    """theta_m = base^(-2m/d), m = 0 .. d/2-1, in float64; base = theta * scaling^(d/(d-2)) (NTK-aware)."""
    base = theta * scaling ** (d / (d - 2)) if scaling != 1.0 else theta
    return base ** (-np.arange(0, d, 2, dtype=np.float64) / d)


def kernel(n: int, d: int, theta: float = 10000.0, scaling: float = 1.0) -> np.ndarray:
    """Toeplitz [n, n] matrix C_ij = c(i - j) = mean_m cos(theta_m (i - j)), float64.

    For isotropic vectors u, v with E[u v^T] = rho I / d, E[<R_i u, R_j v>] = rho * c(i - j): this is the
    factor RoPE puts on expected inner products.
    """
    delta = np.arange(n)[:, None] - np.arange(n)[None, :]
    return np.cos(delta[..., None] * inv_freq(d, theta, scaling)).mean(-1)


def cos_sin(n: int, d: int, theta: float = 10000.0, scaling: float = 1.0, dtype=torch.float32, device=None):
    """cos, sin tables [n, d] for positions 0..n-1 (each plane's angle repeated in both halves)."""
    angles = np.arange(n, dtype=np.float64)[:, None] * inv_freq(d, theta, scaling)[None, :]
    angles = np.concatenate([angles, angles], axis=-1)
    return (torch.tensor(np.cos(angles), dtype=dtype, device=device),
            torch.tensor(np.sin(angles), dtype=dtype, device=device))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE to x [..., n, d]: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
