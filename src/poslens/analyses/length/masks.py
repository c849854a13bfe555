"""Explicit attention masks: causal, optionally windowed, in the form the model's attention function takes.

transformers uses a 4-D mask [B, 1, T, T] as given (no packed-sequence detection, no window of its own), so an
explicit mask is how to (a) run with position ids that do not start at 0 without the mask turning block-diagonal
(transformers reads position ids that do not step by +1 as packed sequences only when no mask is passed) and
(b) impose a window other than the model's. Models whose layers differ in their window (Gemma-2/3, Qwen2/3 and
SmolLM3 with `layer_types`) take a dict {layer type: mask}; the others one mask for every layer, and so does GPT-Neo,
whose local layers hide the keys past their window themselves, on top of the mask (`Family.windows_in_module`).

allowed(i, j) = j <= i  and  i - j < W  (W = 0: no window)  and  key j is a real token (`poslens.masks.allowed`).

A window that keeps the sink (StreamingLLM's and LM-Infinite's masks): the first S keys stay visible to every query
besides the last W - S, so a query still sees at most W keys: allowed(i, j) = j <= i and (i - j < W - S or j < S),
on top of the model's own windows (a key 0 a layer's own window hides stays hidden).
"""

from __future__ import annotations

import torch

from poslens.engine.families import family_of, sliding_windows
from poslens.errors import UsageError
from poslens.masks import additive, allowed, visible


def as_model_mask(allowed: torch.Tensor, model) -> torch.Tensor:
    """`allowed` in the model's attention format: bool for SDPA, additive (0 / dtype min) for eager attention."""
    if not family_of(model.config).eager_output:
        return allowed
    return additive(allowed, model.get_input_embeddings().weight.dtype)


def model_mask(model, n: int, window: int = 0, keys: torch.Tensor | None = None, sinks: int = 0):
    """The explicit mask of `model` for n tokens with every layer's window capped at `window` (0: the model's own
    windows), the first `sinks` keys kept visible besides the last `window - sinks` (module docstring): one tensor,
    or {layer type: tensor} for a model whose layers differ in their window."""
    device = model.get_input_embeddings().weight.device
    native = sliding_windows(model.config)
    if sinks and not 0 < sinks < window:
        raise UsageError(f"a window that keeps {sinks} sink keys needs more than {sinks} keys, got window {window}")

    def capped(w: int) -> int:
        return min(w, window) if w and window else (w or window)

    def layer(w: int) -> torch.Tensor:
        if not sinks:
            return allowed(n, capped(w), keys, device=device)
        return allowed(n, w, keys, device=device) & visible(n, window - sinks, sinks=sinks, device=device)

    if family_of(model.config).windows_in_module:  # GPT-Neo: its local layers' windows on top of this mask
        return as_model_mask(layer(0), model)
    if len(set(native)) == 1:
        return as_model_mask(layer(native[0]), model)
    types = model.config.layer_types
    out = {}
    for t, w in zip(types, native):
        if t not in out:
            out[t] = as_model_mask(layer(w), model)
    return out


def allowed_from(mask, ctx) -> torch.Tensor | None:
    """The bool [B or 1, 1, T, T] mask an explicit run mask imposes on the hooked layer, or None when the run was
    given a [B, T] padding mask or none (the model's causal mask and window then apply). GPT-Neo's local layers hide
    the keys past their window besides (`Family.windows_in_module`)."""
    if isinstance(mask, dict):
        mask = mask[ctx.module.config.layer_types[ctx.layer]]
    if mask is None or mask.dim() != 4:
        return None
    seen = mask if mask.dtype == torch.bool else mask == 0
    if ctx.window and family_of(ctx.module.config).windows_in_module:
        seen = seen & visible(seen.shape[-2], ctx.window, keys=seen.shape[-1], device=seen.device)
    return seen


def right_padded(mask: torch.Tensor) -> torch.Tensor:
    """[B, T] bool of real tokens; a mask whose rows are not a run of ones from position 0 is refused (position t
    must be the t-th token of its sequence)."""
    m = mask.bool()
    lengths = m.sum(1, keepdim=True)
    if not torch.equal(m, torch.arange(m.shape[1], device=m.device)[None] < lengths):
        raise UsageError("attention_mask: length statistics need right padding (each row a run of ones from "
                         "position 0), so that position t is the t-th token of its sequence")
    return m
