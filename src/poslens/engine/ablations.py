"""Ablations applied to a loaded model in place, undone on exit.

`no_rope(model)` removes rotary position embeddings: every rotary-embedding module of the model (Llama, Qwen,
Mistral, Phi-3, Gemma-2, and Gemma-3's single module serving both its local and global layers) returns
cos = 1 and sin = 0, so `apply_rotary_pos_emb` becomes the identity (for Phi-3's partial rotary too) and the
queries and keys carry no position. The causal mask is untouched: this is the paper's NoPE setting applied
to a model trained with RoPE. Any RoPE attention scaling (YaRN, LongRoPE) goes with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from poslens.engine.families import remove_rope, rotary_modules
from poslens.errors import UsageError


@contextmanager
def no_rope(model: nn.Module) -> Iterator[nn.Module]:
    """Disable RoPE in `model` for the duration of the block (cos = 1, sin = 0 everywhere); yields the model."""
    if not rotary_modules(model):
        raise UsageError(f"--no-rope: {type(model).__name__} has no rotary embedding module to disable")
    handles = remove_rope(model)
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
