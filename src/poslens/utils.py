"""TransformerLens's `utils` functions that notebooks call, with its semantics.

    from poslens.utils import get_act_name
    get_act_name("resid_pre", 10)      # "blocks.10.hook_resid_pre"
"""

from __future__ import annotations

from poslens.engine.activation_cache import get_act_name
from poslens.engine.tl_surface import lm_loss as lm_cross_entropy_loss

__all__ = ["get_act_name", "lm_cross_entropy_loss"]
