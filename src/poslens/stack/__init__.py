"""The parameter-free stack of the paper (Eq. 1): configuration, closed forms, Gram flow, Monte Carlo, RoPE."""

from poslens.stack.config import MASKS, NORMS, POSITIONAL, StackConfig, visible

__all__ = ["MASKS", "NORMS", "POSITIONAL", "StackConfig", "visible"]
