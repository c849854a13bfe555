"""TransformerLens 3.9's per-head attention inputs: `blocks.{l}.hook_attn_in` (its use_attn_in) and
`blocks.{l}.hook_q_input`, `hook_k_input`, `hook_v_input` (its use_split_qkv_input).

Each is the residual stream entering the layer (hook_resid_pre, before ln1) copied once per head: [B, T, H, d] for
attn_in and q_input, [B, T, K, d] for k_input and v_input (K key/value heads: TransformerLens does not repeat them
for grouped-query attention). Every head's projection reads its own copy through ln1, so a write to one head's copy
changes only that head's q, k or v. As in TransformerLens, attn_in exists only without grouped-query attention
(K = H), and when any of the split points is hooked the split inputs (copies of resid_pre) feed attention and a write
at attn_in has no effect.

They cost nothing unless hooked; a hook gets them as a view of x, stride 0 over the heads (`LazyCopies`: made real
copies in place before a write or a view), and one that only reads them leaves the model's own projections running
(logits bit-identical to a plain forward). A written copy (replaced, or edited in place: its version counter moved) is
normed by ln1 (the model's own norm; ln1's points fire once, on the shared input) and projected head by head with
that head's rows of W_Q, W_K or W_V (and bias): the projection's output is replaced for that part.
"""

from __future__ import annotations

import torch

from poslens.engine.lazy_copies import LazyCopies, plain
from poslens.errors import UsageError

SPLIT_POINTS = ("hook_q_input", "hook_k_input", "hook_v_input")
INPUT_POINTS = ("hook_attn_in", *SPLIT_POINTS)
BUILT_ON = "every family but GPT-2 (one fused Conv1D) and OLMo-2 (post-norm)"  # where the points exist
GQA_ATTN_IN = ("TransformerLens has no hook_attn_in with grouped-query attention (n_key_value_heads < n_heads); "
               "hook hook_q_input, hook_k_input and hook_v_input instead")


def input_points(n_heads: int, n_kv_heads: int) -> list[str]:
    """The per-head input points of one block (under blocks.{l}.), in forward order."""
    return list(INPUT_POINTS) if n_heads == n_kv_heads else list(SPLIT_POINTS)


def check_attn_in(n_heads: int, n_kv_heads: int) -> None:
    """Refuse attn_in on a grouped-query model, as TransformerLens does."""
    if n_kv_heads != n_heads:
        raise UsageError(GQA_ATTN_IN)


def fire_inputs(fire, pts: dict, x: torch.Tensor, norm, n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    """Fire the hooked input points of one block on copies of the residual stream x [B, T, d]; returns the written
    ones, normed by `norm` (the block's ln1), by part: "q", "k", "v" -> [B, T, heads, d]. `fire(point, value)` calls
    the point's hooks and returns the value or its replacement."""
    if not any(p in pts for p in INPUT_POINTS):
        return {}
    heads = {"q": n_heads, "k": n_kv_heads, "v": n_kv_heads}
    written: dict[str, torch.Tensor] = {}

    def copies(point: str, n: int) -> torch.Tensor | None:
        """The copies after the point's hooks, or None when they only read them."""
        if torch.is_grad_enabled():  # autograd: real copies (a broadcast's storage cannot be swapped under autograd)
            value = x.unsqueeze(2).repeat(1, 1, n, 1)  # one copy per head (a write to one leaves the others)
            seen = value._version
            new = fire(point, value)  # grad mode: never an inference tensor
            return None if new is value and value._version == seen else new
        value = LazyCopies.of(x, n)
        new = fire(point, value)
        if new is value and not value.written():
            return None
        return plain(new)

    if "hook_attn_in" in pts:
        new = copies("hook_attn_in", n_heads)
        if new is not None and not any(p in pts for p in SPLIT_POINTS):  # TransformerLens: split inputs win
            written = {part: new for part in heads}
    for part, n in heads.items():
        point = f"hook_{part}_input"
        if point in pts:
            new = copies(point, n)
            if new is not None:
                written[part] = new
    forward = type(norm).forward  # the model's norm, without poslens's points (they fire on the shared input)
    return {part: forward(norm, value) for part, value in written.items()}


def input_projection_hook(inputs_of, parts: list[tuple[str, int, int]]):
    """A forward hook on a projection whose output holds `parts` side by side (point "attn.hook_q" / "_k" / "_v",
    width, head width): each part with a written input (`inputs_of()`: part -> normed [B, T, heads, d]) is replaced
    by that input projected head by head with the part's rows of the weight (and bias). Registered before the
    attn.hook_q/k/v hooks, so those see the result."""
    widths = [w for _, w, _ in parts]

    def hook(module, args, out):
        inputs = inputs_of()
        if not inputs:
            return None
        pieces = list(out.split(widths, -1))
        weights = module.weight.split(widths, 0)
        biases = module.bias.split(widths, 0) if module.bias is not None else [None] * len(parts)
        changed = False
        for i, (point, _, d) in enumerate(parts):
            value = inputs.get(point[-1])
            if value is None:
                continue
            bias = None if biases[i] is None else biases[i].unflatten(0, (-1, d))
            pieces[i] = _per_head(point, value, weights[i].unflatten(0, (-1, d)), bias).flatten(-2).to(out.dtype)
            changed = True
        return torch.cat(pieces, -1) if changed else None

    return hook


def per_head_input_projection_hook(inputs_of, heads: int, d: int, groups: int | None = None):
    """`input_projection_hook` for a projection whose output holds each head's [q | k | v] side by side ([B, T,
    heads * 3 * D]: GPT-NeoX's, BLOOM's and multi-head Falcon's query_key_value), or with `groups` K, K groups of
    (H/K query heads, one key head, one value head) (Falcon's new architecture): each written part's D columns of every
    head are that head's copy projected with its rows of the weight (and bias)."""
    k = groups or heads  # groups: [K, H/K + 2, D]; per head: [H, 3, D], one query head in each
    g = heads // k if groups else 1
    slots = {"q": slice(0, g), "k": g, "v": g + 1}

    def hook(module, args, out):
        inputs = inputs_of()
        if not inputs:
            return None
        new = out.unflatten(-1, (k, g + 2, d)).clone()  # [B, T, K, slots, D]
        weight = module.weight.unflatten(0, (k, g + 2, d))  # [K, slots, D, d_model]
        bias = None if module.bias is None else module.bias.unflatten(0, (k, g + 2, d))
        for part, slot in slots.items():
            value = inputs.get(part)
            if value is None:
                continue
            w = weight[:, slot].flatten(0, 1) if part == "q" else weight[:, slot]  # [heads of the part, D, d_model]
            b = None if bias is None else (bias[:, slot].flatten(0, 1) if part == "q" else bias[:, slot])
            y = _per_head(f"attn.hook_{part}", value, w, b).to(out.dtype)  # [B, T, heads of the part, D]
            new[..., slot, :] = y.unflatten(2, (k, g)) if part == "q" else y
        return new.flatten(-3)

    return hook


def _per_head(point: str, value: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Each head's copy [B, T, heads, d_model] times that head's rows w [heads, D, d_model] (plus b [heads, D]):
    [B, T, heads, D]."""
    if w.shape[0] != value.shape[-2]:
        raise UsageError(f"{point}: {value.shape[-2]} input copies for {w.shape[0]} heads")
    y = torch.einsum("bthm,hdm->bthd", value.to(w.dtype), w)
    return y + b if b is not None else y
