"""TransformerLens's `utils` functions that notebooks call, with its semantics.

    from poslens.utils import get_act_name
    get_act_name("resid_pre", 10)      # "blocks.10.hook_resid_pre"

Any other TransformerLens utility fails in one line (NoEquivalent).
"""

from __future__ import annotations

import numpy as np
import torch

from poslens.engine.activation_cache import NoEquivalent, get_act_name
from poslens.engine.tl_surface import lm_loss as lm_cross_entropy_loss

__all__ = ["get_act_name", "get_corner", "lm_cross_entropy_loss", "to_numpy"]


def to_numpy(tensor) -> np.ndarray:
    """A tensor (or array, or list) as a numpy array, detached and on the CPU."""
    if isinstance(tensor, torch.Tensor):
        return tensor.detach().cpu().numpy()
    return np.asarray(tensor)


def get_corner(tensor, n: int = 3):
    """The leading n x n x ... corner of a tensor (its first n entries along every dimension)."""
    return tensor[tuple(slice(n) for _ in range(tensor.ndim))]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise NoEquivalent(f"poslens.utils has no {name!r}: TransformerLens's utils.{name} has no poslens equivalent "
                       f"(poslens.utils has {', '.join(__all__)})")
