"""poslens: how decoder-only transformers get positional information (causal mask, RoPE, and both)."""

from poslens.io.results import Run, load

__version__ = "0.1.0"
__all__ = ["Run", "load", "__version__"]
