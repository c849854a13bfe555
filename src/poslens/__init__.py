"""poslens: how decoder-only transformers get positional information (causal mask, RoPE, and both)."""

from __future__ import annotations

__version__ = "0.2.0"
__all__ = ["Run", "load", "__version__"]


def load(path, tensors: bool = True):
    """Load a run directory written by any poslens command (see `poslens.io.results.load`)."""
    from poslens.io.results import load as _load

    return _load(path, tensors=tensors)


def __getattr__(name: str):  # `poslens.Run` without importing torch at `import poslens` (fast `poslens --help`)
    if name == "Run":
        from poslens.io.results import Run

        return Run
    raise AttributeError(f"module 'poslens' has no attribute {name!r}")
