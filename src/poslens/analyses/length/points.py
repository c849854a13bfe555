"""Where the length pieces read and write on the hook engine, under either spelling of the attention points.

The hook engine is moving to TransformerLens's meanings (issue 16): `attn.hook_q` becomes the projection before
any q-norm and RoPE, laid out [batch, pos, head, d_head], the rotated queries become `attn.hook_rot_q`, the final
norm's `hook_normalized` becomes the value before its gain (the value after it is `hook_out`), and `ctx.q`/`ctx.k`
become `ctx.rot_q`/`ctx.rot_k`. These helpers pick whichever the running engine has, so the statistics and
interventions of this package mean the same thing before and after that change:

* the queries that a per-query logit scale multiplies are those *after* any q-norm (a norm would undo a scale
  written before it) and RoPE (a per-position scalar commutes with the rotation, so after is as good as before);
* the LM head reads the final norm's output *with* its gain.
"""

from __future__ import annotations

import torch


def final_norm_point(hm) -> str:
    """The point whose value the LM head reads: the final norm's output after its gain."""
    return "ln_final.hook_out" if "ln_final.hook_out" in hm.points else "ln_final.hook_normalized"


def query_point(hm, layer: int) -> tuple[str, int]:
    """(name, position axis) of layer `layer`'s queries after q-norm and RoPE (GPT-2, no rotation and no q-norm:
    attn.hook_q, [batch, pos, head, d_head] as TransformerLens)."""
    rot = f"blocks.{layer}.attn.hook_rot_q"
    return (rot, 1) if rot in hm.points else (f"blocks.{layer}.attn.hook_q", 1)


def key_point(hm, layer: int) -> tuple[str, int]:
    """(name, position axis) of layer `layer`'s keys after k-norm and RoPE (GPT-2: attn.hook_k)."""
    rot = f"blocks.{layer}.attn.hook_rot_k"
    return (rot, 1) if rot in hm.points else (f"blocks.{layer}.attn.hook_k", 1)


def rotated(ctx) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries [B, H, T, D] and keys [B, K, T, D] the attention kernel reads, from a hook's context."""
    if "rot_q" in type(ctx).__dataclass_fields__:
        return ctx.rot_q, ctx.rot_k
    return ctx.q, ctx.k
