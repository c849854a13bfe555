"""The parameter-free decoder stack of the paper (Eq. 1) as one validated configuration.

Every parameter-free tool (closed forms, Gram flow, Monte Carlo) takes a `StackConfig`, so a run is
described once and the same knobs mean the same thing everywhere.

One layer (paper Eq. 1, generalised):
    Y = Norm(X)                          l2: rows scaled to norm 1; LayerNorm: centred rows of norm sqrt(d)
    S = mask(R(Y) R(Y)^T / s)            R = RoPE (identity for NoPE); s = 1, sqrt(d) or d (see `score_divisor`)
    X' = softmax(S) Y (+ X if residual)  values are the un-rotated Y
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from poslens.errors import UsageError, check_choice, check_float, check_int, require

NORMS = ("l2", "layernorm-sqrt-d", "layernorm-d")
MASKS = ("causal", "none", "sliding")
POSITIONAL = ("none", "rope")


@dataclass(frozen=True)
class StackConfig:
    """Knobs of the parameter-free stack. Defaults are the paper's (Section 4.1): n=50, d=64, 4 layers, l2."""

    n: int = 50
    d: int = 64
    alpha: float = 0.0
    layers: int = 4
    norm: str = "l2"
    residual: bool = True
    positional: str = "none"
    rope_theta: float = 10000.0
    rope_scaling: float = 1.0
    mask: str = "causal"
    window: int | None = None

    def __post_init__(self) -> None:
        check_int("n", self.n, 2)
        check_int("d", self.d, 1)
        check_float("alpha", self.alpha, 0.0, 1.0, hi_open=True)
        check_int("layers", self.layers, 1)
        check_choice("norm", self.norm, NORMS)
        check_choice("positional", self.positional, POSITIONAL)
        check_choice("mask", self.mask, MASKS)
        if self.positional == "rope":
            require(self.d % 2 == 0, f"d must be even with RoPE (pairs of dimensions rotate together), got {self.d}")
            require(self.rope_theta > 1.0, f"rope_theta must be > 1, got {self.rope_theta:g}")
            require(self.rope_scaling >= 1.0, f"rope_scaling must be >= 1 (NTK scaling), got {self.rope_scaling:g}")
        if self.mask == "sliding":
            require(self.window is not None, "mask 'sliding' needs a window: pass --window W with W >= 1")
            check_int("window", self.window, 1)
        elif self.window is not None:
            raise UsageError(f"window is only used with mask 'sliding', got mask {self.mask!r}; drop --window")

    @property
    def score_divisor(self) -> float:
        """s in S = Y Y^T / s. l2: 1. LayerNorm rows have norm sqrt(d): 'sqrt-d' divides by sqrt(d), 'd' by d."""
        return {"l2": 1.0, "layernorm-sqrt-d": math.sqrt(self.d), "layernorm-d": float(self.d)}[self.norm]

    @property
    def row_norm(self) -> float:
        """Norm of every row of Y = Norm(X): 1 for l2, sqrt(d) for LayerNorm."""
        return 1.0 if self.norm == "l2" else math.sqrt(self.d)

    def to_dict(self) -> dict:
        return asdict(self)


def visible(n: int, mask: str = "causal", window: int | None = None) -> np.ndarray:
    """Boolean [n, n] matrix, True where query i may attend to key j.

    causal: j <= i; none: all pairs; sliding: 0 <= i - j < window (the Hugging Face convention, self included).
    """
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    if mask == "none":
        return np.ones((n, n), dtype=bool)
    if mask == "causal":
        return j <= i
    if mask == "sliding":
        return (j <= i) & (i - j < int(window))
    raise UsageError(f"mask must be one of {', '.join(MASKS)}; got {mask!r}")
