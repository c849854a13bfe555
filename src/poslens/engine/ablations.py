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

import torch
from torch import nn

from poslens.errors import UsageError


def rotary_modules(model: nn.Module) -> list[nn.Module]:
    """The rotary-embedding modules of `model` (by class name: transformers' `*RotaryEmbedding`)."""
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def _identity_rotation(module: nn.Module, args, output):
    cos, sin = output
    return torch.ones_like(cos), torch.zeros_like(sin)


@contextmanager
def no_rope(model: nn.Module) -> Iterator[nn.Module]:
    """Disable RoPE in `model` for the duration of the block (cos = 1, sin = 0 everywhere); yields the model."""
    modules = rotary_modules(model)
    if not modules:
        raise UsageError(f"--no-rope: {type(model).__name__} has no rotary embedding module to disable")
    handles = [m.register_forward_hook(_identity_rotation) for m in modules]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
