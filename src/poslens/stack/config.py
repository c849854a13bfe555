"""The parameter-free decoder stack of the paper (Eq. 1) as one validated configuration.

Every parameter-free tool (closed forms, Gram flow, Monte Carlo) takes a `StackConfig`, so a run is
described once and the same knobs mean the same thing everywhere.

One layer (paper Eq. 1, generalised):
    Y = Norm(X)                          l2: rows scaled to norm 1; LayerNorm: centred rows of norm sqrt(d)
    S = mask(R(Y) R(Y)^T / s)            R = RoPE (identity for NoPE); s = 1, sqrt(d) or d (see `score_divisor`)
    X' = softmax(S) Y (+ X if residual)  values are the un-rotated Y
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

import numpy as np

from poslens import masks
from poslens.errors import UsageError, check_choice, check_float, check_int, check_real, require
from poslens.options import default_of, option

NORMS = ("l2", "layernorm-sqrt-d", "layernorm-d")
MASKS = ("causal", "none", "sliding")
POSITIONAL = ("none", "rope")


@dataclass(frozen=True)
class StackConfig:
    """Knobs of the parameter-free stack. Defaults are the paper's (Section 4.1): n=50, d=64, 4 layers, l2."""

    n: int = option(50, help="tokens per sequence n", flag="--seq-len", aliases=("--n",))
    d: int = option(64, help="hidden size d", aliases=("--hidden-size",))
    alpha: float = option(0.0, help="expected inner product of inputs, in [0, 1)")
    layers: int = option(4, help="number of layers")
    norm: str = option("l2", help="normalisation: l2 (rows of norm 1) or LayerNorm with scores divided by sqrt(d) "
                       "or d", choices=NORMS)
    residual: bool = option(True, help="drop the residual connection")
    positional: str = option("none", help="positional encoding", choices=POSITIONAL, flag="--pe")
    rope_theta: float = option(10000.0, help="RoPE base theta")
    rope_scaling: float = option(1.0, help="NTK-style RoPE base scaling factor s >= 1: base * s^(d/(d-2)); 1 is none")
    mask: str = option("causal", help="attention mask", choices=MASKS)
    window: int | None = option(None, help="window W for --mask sliding (keys i-W < j <= i)")

    def __post_init__(self) -> None:
        # Types first (a string or NaN must not slip through to fail later), then ranges. Sizes are only
        # bounded below here; what a run can hold in memory is checked by the tool that runs it.
        # Numbers are stored as plain int / float (3.0 -> 3, numpy scalars -> Python), so every tool sees one type.
        set_ = object.__setattr__
        set_(self, "n", check_int("n", self.n, 2))
        set_(self, "d", check_int("d", self.d, 1))
        set_(self, "alpha", check_float("alpha", self.alpha, 0.0, 1.0, hi_open=True))
        set_(self, "layers", check_int("layers", self.layers, 1))
        check_choice("norm", self.norm, NORMS)
        require(isinstance(self.residual, (bool, np.bool_)), f"residual must be True or False, got {self.residual!r}")
        set_(self, "residual", bool(self.residual))
        check_choice("positional", self.positional, POSITIONAL)
        check_choice("mask", self.mask, MASKS)
        theta = check_real("rope_theta", self.rope_theta)
        scaling = check_real("rope_scaling", self.rope_scaling)
        set_(self, "rope_theta", theta)
        set_(self, "rope_scaling", scaling)
        if self.positional == "rope":
            require(self.d % 2 == 0, f"d must be even with RoPE (pairs of dimensions rotate together), got {self.d}")
            require(theta > 1.0, f"rope_theta must be > 1, got {theta:g}")
            require(scaling >= 1.0, f"rope_scaling must be >= 1 (NTK scaling), got {scaling:g}")
            if scaling != 1.0:
                require(self.d > 2, f"rope_scaling needs d >= 4 (NTK base theta * s^(d/(d-2))), got d={self.d}")
                # The scaled base theta * s^(d/(d-2)) must be a finite float64.
                log_base = math.log(theta) + self.d / (self.d - 2) * math.log(scaling)
                require(log_base < math.log(np.finfo(np.float64).max),
                        f"rope_theta {theta:g} with rope_scaling {scaling:g} gives an infinite RoPE base; "
                        "use a smaller rope_scaling")
        else:  # without RoPE the base and its scaling do nothing: a run recording them would mislead
            defaults = {f.name: default_of(f) for f in dataclasses.fields(self)}
            for name, value in (("rope_theta", theta), ("rope_scaling", scaling)):
                if value != defaults[name]:
                    raise UsageError(f"{name} {value:g} has no effect without RoPE (positional "
                                     f"{self.positional!r}); use RoPE or leave {name} out", param=name)
        if self.mask == "sliding":
            if self.window is None:
                raise UsageError("window is required with mask 'sliding' (a number of keys >= 1)", param="window")
            set_(self, "window", check_window(self.window, self.n))
        elif self.window is not None:
            raise UsageError(f"window is only used with mask 'sliding', got mask {self.mask!r}", param="window")

    @property
    def score_divisor(self) -> float:
        """s in S = Y Y^T / s. l2: 1. LayerNorm rows have norm sqrt(d): 'sqrt-d' divides by sqrt(d), 'd' by d."""
        return {"l2": 1.0, "layernorm-sqrt-d": math.sqrt(self.d), "layernorm-d": float(self.d)}[self.norm]

    @property
    def row_norm(self) -> float:
        """Norm of every row of Y = Norm(X): 1 for l2, sqrt(d) for LayerNorm."""
        return 1.0 if self.norm == "l2" else math.sqrt(self.d)

    def operations(self, samples: int) -> float:
        """About how many floating-point operations `samples` Monte Carlo samples of this stack take: per layer
        R(Y) R(Y)^T and softmax(S) Y, n^2 d multiply-adds each (for `poslens.errors.check_duration`)."""
        return 4.0 * samples * self.layers * self.n ** 2 * self.d

    def to_dict(self) -> dict:
        return asdict(self)


def check_window(window: int, n: int) -> int:
    """A sliding window of W keys (i - W < j <= i) for sequences of n tokens: 1 <= W <= n."""
    window = check_int("window", window, 1)
    if window > n:
        raise UsageError(f"window must be at most the sequence length n = {n} (a window of n keys already sees "
                         f"every earlier token), got {window}", param="window")
    return window


def visible(n: int, mask: str = "causal", window: int | None = None) -> np.ndarray:
    """Boolean [n, n] matrix, True where query i may attend to key j.

    causal: j <= i; none: all pairs; sliding: 0 <= i - j < window (the Hugging Face convention, self included);
    the causal ones are `poslens.masks.visible`.
    """
    if mask == "none":
        return np.ones((n, n), dtype=bool)
    if mask == "causal":
        return masks.visible(n).numpy()
    if mask == "sliding":
        return masks.visible(n, int(window)).numpy()
    raise UsageError(f"mask must be one of {', '.join(MASKS)}; got {mask!r}")
