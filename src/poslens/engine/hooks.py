"""Hook points on every supported model, with the names, meanings and layouts of TransformerLens 3.9.

    hm = HookedModel(model)
    hm.run(input_ids, hooks={"blocks.0.attn.hook_rot_q": read, "blocks.3.attn.hook_z": patch})
    logits, cache = hm.run_with_cache(input_ids)       # as TransformerLens's HookedTransformer.run_with_cache
    logits = hm.run_with_hooks(input_ids, fwd_hooks=[("blocks.3.attn.hook_q", fn)])   # fn(x, hook), as TL's
    # and the rest of TransformerLens's model surface: poslens.engine.tl_surface, poslens.engine.tl_weights

A hook is `fn(x, ctx)`: return None to read, or a tensor of x's shape to replace x for the rest of the forward; an
edit of x in place takes effect too, as in TransformerLens (where the model would recompute a value from scratch -
rsqrt instead of the hooked scale - a tensor whose version counter moved during its hooks is used as a replacement;
one untouched lets the model's own kernels run). A replacement takes effect
downstream as in TransformerLens: one written at `attn.hook_q` is q-normed (where the model
has a q-norm) and rotated afterwards; one written at `ln1.hook_normalized` is multiplied by the gain. `ctx` (a
HookContext) names the point and layer; at the attention kernel's points (`attn.hook_rot_q` to `attn.hook_z`) it also
holds `rot_q`, `rot_k` and `v` as the kernel receives them ([B, H, T, D], heads before positions), `scaling`, `window`
and `softcap`. The run ends after the last hooked point (no LM head) unless `logits=True`; with read-only hooks the
model's outputs are bit-identical to a plain forward, and nothing a hook does not ask for is computed. The one
exception: the [B, H, T, T] scores and pattern exist only if a hook at `attn.hook_attn_scores` or `attn.hook_pattern`
takes them as a tensor, and then attention's output is computed from that pattern, as the model's eager attention
computes it, op for op (`EagerSteps`): the pattern read is the one that weighted the values, and the outputs are
bit-identical to the model under eager attention, within float rounding of its SDPA forward. A reader marked with
`from_factors` gets None and works from ctx.rot_q and ctx.rot_k (e.g. a head-summed GEMM): no map, the model's kernel.

How: while a run is active, each decoder layer's forward is poslens's block forward below (the two residual lines);
a norm with a hooked point runs poslens's copy of the family's RMSNorm (the same operations, with its points); the
projections (q, k, v, gate, up, down) get module hooks; attention goes through a registered transformers attention
function that fires the kernel's points and then calls the model's own attention (SDPA, or the family's eager one),
or, when the pattern is formed, computes the output from it.

Points, in forward order (l = layer from 0; B batch, T tokens, d width, H query heads, K key/value heads, D head
width, M MLP width; TL = TransformerLens 3.9's HookedTransformer has this name with this meaning and layout; the
`*.hook_out` names are poslens's own, as TransformerLens 4's bridge names them):

    hook_embed                          [B, T, d]     TL  token embeddings (Gemma: after its sqrt(d) scale; BLOOM:
                                                          after its embedding LayerNorm, as TransformerLens)
    embed.ln.hook_scale, _normalized    as ln1        TL  BLOOM: the LayerNorm after the token embedding
    hook_pos_embed                      [B, T, d]     TL  GPT-2, OPT: the position table's rows at the positions
                                                          (added to hook_embed); only on a family with a table
    blocks.{l}.hook_resid_pre           [B, T, d]     TL  the residual stream entering layer l
    blocks.{l}.hook_attn_in             [B, T, H, d]  TL  resid_pre copied per head, the input of every head's q, k, v
                                                          (TL's use_attn_in; only without grouped-query attention)
    blocks.{l}.hook_q_input             [B, T, H, d]  TL  resid_pre copied per query head (TL's use_split_qkv_input);
    blocks.{l}.hook_k_input, _v_input   [B, T, K, d]  TL  per key/value head: each head's projection reads its own
                                                          copy through ln1 (poslens.engine.tl_inputs; every
                                                          family but GPT-2 and OLMo-2)
    blocks.{l}.ln1.hook_scale           [B, T, 1]     TL  sqrt(mean(x^2) + eps) of the input norm (float32); OLMo-2
                                                          (post-norm): ln1 is the norm after attention, fired after
                                                          attn.hook_out, and ln2 the norm after the MLP
    blocks.{l}.ln1.hook_normalized      [B, T, d]     TL  x / scale, before the gain (float32)
    blocks.{l}.ln1.hook_out             [B, T, d]         after the gain: what attention reads
    blocks.{l}.attn.hook_q              [B, T, H, D]  TL  q_proj output: before any q-norm and RoPE (GPT-NeoX,
                                                          BLOOM: a view of each head's q in its fused query_key_value)
    blocks.{l}.attn.q_norm.hook_*       [B*T*H, .]    TL  Qwen3, Gemma-3: the per-head RMSNorm of q (scale [., 1],
                                                          normalized and out [., D]; TL's flattened layout); OLMo-2:
                                                          [B, T, .], one RMSNorm over the whole projection (H*D)
    blocks.{l}.attn.hook_k              [B, T, K, D]  TL  k_proj output (K heads: not repeated for GQA, as TL)
    blocks.{l}.attn.k_norm.hook_*       [B*T*K, .]    TL  Qwen3, Gemma-3: the per-head RMSNorm of k
    blocks.{l}.attn.hook_v              [B, T, K, D]  TL  v_proj output
    blocks.{l}.attn.hook_rot_q          [B, T, H, D]  TL  queries after q-norm and RoPE (as q on a layer without RoPE;
                                                          none on GPT-2, as in TL: ctx.rot_q is q there)
    blocks.{l}.attn.hook_rot_k          [B, T, K, D]  TL  keys after k-norm and RoPE
    blocks.{l}.attn.hook_attn_scores    [B, H, T, T]  TL  rot_q . rot_k * scaling (Gemma-2: after the softcap; BLOOM:
                                                          plus ALiBi's slope_h * (j - i), ctx.score_bias), -inf
                                                          where masked
    blocks.{l}.attn.hook_pattern        [B, H, T, T]  TL  softmax of the scores (0 on rows with no visible key)
    blocks.{l}.attn.hook_z              [B, T, H, D]  TL  per-head attention output, before W_O
    blocks.{l}.attn.hook_result         [B, T, H, d]  TL  each head's output after W_O (TL's use_attn_result; summed,
                                                          plus W_O's bias, it is attn.hook_out)
    blocks.{l}.attn.hook_out            [B, T, d]         after W_O (Gemma: before its post-attention norm)
    blocks.{l}.ln1_post.hook_*          as ln1        TL  Gemma: the norm after attention (post_attention_layernorm)
    blocks.{l}.hook_attn_out            [B, T, d]     TL  what attention adds to the residual stream (Gemma: after
                                                          ln1_post)
    blocks.{l}.hook_resid_mid           [B, T, d]     TL  after the attention residual (none in a parallel block:
                                                          GPT-NeoX, GPT-J, Phi, as TL's parallel_attn_mlp)
    blocks.{l}.hook_mlp_in              [B, T, d]     TL  a copy of resid_mid that only the MLP reads (TL's
                                                          use_hook_mlp_in; parallel block: of resid_pre)
    blocks.{l}.ln2.hook_*               as ln1        TL  the norm before the MLP (Gemma: pre_feedforward_layernorm;
                                                          GPT-J, Phi: their one norm again, on the MLP's input)
    blocks.{l}.mlp.hook_pre             [B, T, M]     TL  gate projection, before the activation
    blocks.{l}.mlp.hook_pre_linear      [B, T, M]     TL  up projection
    blocks.{l}.mlp.hook_post            [B, T, M]     TL  act(pre) * pre_linear: the down projection's input
    blocks.{l}.mlp.hook_expert_weights  [B*T, E]      TL  a mixture of experts' layer (Mixtral, Qwen2-MoE, Qwen3-MoE,
                                                          OLMoE) in place of the three above: the router's softmax
                                                          over its E experts (float32, before the top k)
    blocks.{l}.mlp.hook_expert_indices  [B*T, k]      TL  the k experts each token is sent to
    blocks.{l}.mlp.experts.{e}.hook_gate, hook_pre, hook_post
                                        [n_e, M]      TL  expert e's gate and up projections and act(gate) * up, on
                                                          the n_e tokens routed to it (by choice slot, then
                                                          token; `HookedModel._moe`)
    blocks.{l}.mlp.shared_expert.hook_* [B, T, M]         Qwen2-MoE's shared expert, as a dense MLP's three points
    blocks.{l}.mlp.hook_out             [B, T, d]         the MLP's output (Gemma: before its post-MLP norm)
    blocks.{l}.ln2_post.hook_*          as ln1        TL  Gemma: the norm after the MLP (post_feedforward_layernorm)
    blocks.{l}.hook_mlp_out             [B, T, d]     TL  what the MLP adds to the residual stream (Gemma: after
                                                          ln2_post)
    blocks.{l}.hook_resid_post          [B, T, d]     TL  the residual stream leaving layer l
    ln_final.hook_*                     as ln1        TL  the final norm (before the LM head)
    unembed.hook_in                     [B, T, d]     TL  the LM head's input (= ln_final.hook_out)
    unembed.hook_out                    [B, T, V]     TL  the LM head's output (Gemma-2: before its final softcap);
                                                          hooking either runs the LM head

docs/hooks.md has the details, where poslens differs from TransformerLens and why.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import types
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask

from poslens.engine.activation_cache import NoEquivalent
from poslens.engine.allocator import keep_freed_memory
from poslens.engine.families import (
    Family,
    alibi_builder,
    base_part,
    decoder_layers,
    family_of,
    head_dim,
    kv_heads,
    layer_attention,
    layer_index,
    mlp_block,
    mlp_module,
    norm_affine,
    norm_eps,
    sparse_mlp,
)
from poslens.engine.lazy_copies import LazyCopies, plain
from poslens.engine.models import position_limit
from poslens.engine.tl_inputs import (
    BUILT_ON,
    GQA_ATTN_IN,
    fire_inputs,
    input_points,
    input_projection_hook,
    per_head_input_projection_hook,
)
from poslens.engine.tl_surface import (  # noqa: F401  (TLHook: imported from here before)
    MODEL_HINTS,
    PROCESSING,
    TL_MODEL_NAMES,
    TLHook,
    TransformerLensSurface,
)
from poslens.engine.tl_weights import TLConfig, TLWeights, tl_config
from poslens.errors import UsageError
from poslens.masks import additive
from poslens.masks import hidden as hidden_keys

ATTN_SDPA = "poslens_hooks"
ATTN_EAGER = "poslens_hooks_eager"
_OWNER = "_poslens_hooked"  # attribute on the attention modules and layers of a model with a run in progress

NORM_POINTS = ("hook_scale", "hook_normalized", "hook_out")  # every norm's points, under its prefix
KERNEL_POINTS = ("attn.hook_rot_q", "attn.hook_rot_k", "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z")

# TransformerLens names poslens has no equivalent for, and what to do instead
TL_ONLY = {"hook_tokens": "the token ids are ctx.input_ids"}
NO_POS_EMBED = ("the model adds no position embedding to its residual stream: its positions act inside attention (RoPE "
                "at attn.hook_rot_q/rot_k, ALiBi's bias in attn.hook_attn_scores) or come from the causal mask alone "
                "(NoPE)")  # hook_pos_embed on a model without a position table

HookFn = Callable[[Any, "HookContext"], Any]


def norm_points(prefix: str) -> list[str]:
    """The points of one norm: TransformerLens's scale and normalized (before the gain), and its output."""
    return [f"{prefix}.{p}" for p in NORM_POINTS]


def moe_points(block: torch.nn.Module) -> list[str]:
    """The points of a mixture-of-experts MLP (under blocks.{l}.) in forward order: Qwen2-MoE's shared expert (its
    gate and up projections and act(gate) * up, poslens's names after the dense MLP's), then TransformerLens's router
    points and each expert's."""
    shared = ["mlp.shared_expert.hook_pre", "mlp.shared_expert.hook_pre_linear", "mlp.shared_expert.hook_post"]
    return [*(shared if hasattr(block, "shared_expert") else []), "mlp.hook_expert_weights", "mlp.hook_expert_indices",
            *[f"mlp.experts.{e}.{p}" for e in range(block.experts.num_experts)
              for p in ("hook_gate", "hook_pre", "hook_post")]]


def block_points(family: Family, qk_norm: bool, inputs: list[str] | tuple = (),
                 moe: torch.nn.Module | None = None) -> list[str]:
    """The points of one block (under blocks.{l}.) in forward order (`inputs`: the per-head attention inputs,
    poslens.engine.tl_inputs; `moe`: the layer's mixture-of-experts block, whose points replace a dense MLP's)."""
    dense = ["mlp.hook_pre", *(["mlp.hook_pre_linear"] if family.gated_mlp else []), "mlp.hook_post"]
    sandwich, post = family.layout == "sandwich", family.layout == "post-norm"
    mid = [] if family.layout == "parallel" else ["hook_resid_mid"]  # TransformerLens's parallel_attn_mlp: none
    return ["hook_resid_pre", *inputs, *([] if post else norm_points("ln1")),
            "attn.hook_q", *(norm_points("attn.q_norm") if qk_norm else []),
            "attn.hook_k", *(norm_points("attn.k_norm") if qk_norm else []),
            "attn.hook_v", *(KERNEL_POINTS[2:] if family.pos_embed_attr or family.alibi else KERNEL_POINTS),  # GPT-2,
            # OPT, BLOOM: no rot_q, rot_k (as TransformerLens)
            "attn.hook_result", "attn.hook_out",
            *(norm_points("ln1_post") if sandwich else norm_points("ln1") if post else []), "hook_attn_out",
            *mid, "hook_mlp_in", *([] if post else norm_points("ln2")),
            *(dense if moe is None else moe_points(moe)), "mlp.hook_out",
            *(norm_points("ln2_post") if sandwich else norm_points("ln2") if post else []), "hook_mlp_out",
            "hook_resid_post"]


# TransformerLens's optional points: hooked by name; run_with_cache's default and a names_filter function select them
# only after set_use_attn_result(True) / set_use_hook_mlp_in(True), as TransformerLens fires them only then
OPTIONAL = {"attn.hook_result": "use_attn_result", "hook_mlp_in": "use_hook_mlp_in", "hook_attn_in": "use_attn_in",
            "hook_q_input": "use_split_qkv_input", "hook_k_input": "use_split_qkv_input",
            "hook_v_input": "use_split_qkv_input"}


def is_transformer_lens_name(name: str) -> bool:
    """Whether TransformerLens 3.9 has the point: every name but poslens's own `*.hook_out` (unembed.hook_out is
    TransformerLens's)."""
    return not name.endswith(".hook_out") or name.startswith("unembed.")


def from_factors(fn: HookFn) -> HookFn:
    """Mark a reader of `attn.hook_attn_scores` that works from ctx.rot_q and ctx.rot_k: it gets None, no scores are
    formed."""
    def reader(x, ctx):
        return fn(x, ctx)

    reader.poslens_from_factors = True
    return reader


@dataclass
class HookContext:
    """What a hook sees besides the value: the point, the layer, the batch and (kernel points) what attention reads."""

    name: str
    layer: int | None
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None  # [B, T] as passed to run() (1 = real token), or None
    position_ids: torch.Tensor | None
    rot_q: torch.Tensor | None = None  # [B, H, T, D] queries after q-norm and RoPE, as the kernel reads them
    rot_k: torch.Tensor | None = None  # [B, K, T, D] keys after k-norm and RoPE (not repeated for GQA); ALiBi
    # (BLOOM, Falcon-RW), for a reader that works from the factors (`from_factors`) only: both [B, H, T, D + 2], q
    # and k with two coordinates that carry the bias, [q, 1, -b_i / scaling] and [k, b_j / scaling, 1] for the
    # per-key bias b (key_bias), so that rot_q . rot_k * scaling is the score with ALiBi's bias as TransformerLens puts
    # it (score_bias); every other hook sees them as the kernel reads them
    v: torch.Tensor | None = None  # [B, K, T, D] values
    scaling: float | None = None
    window: int = 0  # sliding window of this layer (0 = none)
    softcap: float | None = None
    module: Any = None
    key_bias: torch.Tensor | None = None  # ALiBi (BLOOM): [B, H, T] the model's bias per key, slope * key position

    @property
    def score_bias(self) -> torch.Tensor | None:
        """ALiBi's bias in the scores as TransformerLens puts it, [B, H, Tq, Tk]: slope * (j - i) for key j of query i
        (the model adds slope * j; the two differ by a constant per query, which the softmax ignores); None without."""
        if self.key_bias is None:
            return None
        n = self.key_bias.shape[-1] if self.rot_q is None else self.rot_q.shape[-2]  # the queries: the last n keys
        return self.key_bias[..., None, :] - self.key_bias[..., -n:, None]

    @property
    def q(self):
        raise NoEquivalent("ctx.q is now ctx.rot_q (after q-norm and RoPE, [B, H, T, D]); the projection before RoPE "
                           "is the value at attn.hook_q ([B, T, H, D], as TransformerLens)")

    @property
    def k(self):
        raise NoEquivalent("ctx.k is now ctx.rot_k (after k-norm and RoPE, [B, K, T, D]); the projection before RoPE "
                           "is the value at attn.hook_k ([B, T, K, D], as TransformerLens)")


class _Replaced:
    """A module's forward replaced by an instance attribute for one run; `remove()` puts the class's back (the
    handle interface of register_forward_hook)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        del self.module.forward


class _Stop(Exception):
    """Raised after the last hooked point to end a forward early."""


@dataclass
class _Run:
    """One forward in progress: the hooks by point (and by layer), the points still to fire, the batch."""

    by_point: dict[str, list[HookFn]]
    per_layer: dict[int, dict[str, list[HookFn]]]  # layer -> point under blocks.{l}. -> hooks
    pending: set[str]  # hooked points not fired yet: the forward ends when none is left (unless to_end)
    to_end: bool
    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    hidden: dict = field(default_factory=dict)  # what every layer of one forward shares, computed once (`_memo`):
    # the [Tq, Tk] 0 / -inf bias of the implicit mask (_dense_scores), the keys a model's mask hides (_hide), ALiBi's
    # bias in TransformerLens's form
    inputs: dict = field(default_factory=dict)  # layer -> written per-head attention inputs (tl_inputs.fire_inputs)
    shared_norm: dict = field(default_factory=dict)  # layer -> (scale, normalized, output) of GPT-J's and Phi's one
    # norm at ln1, untouched by its hooks: ln2's points read them again (`_layer_norm`)
    keys: int | None = None  # a cached generation step: the sequence's length so far (the attention points' keys)


def _copy_point(fire, point: str, x: torch.Tensor) -> torch.Tensor:
    """Fire a point whose value is a copy of x that only what follows reads (hook_mlp_in): the hooks get a copy made
    only if they write it (`LazyCopies`); x itself when they only read (the model's own tensor, the same values)."""
    if torch.is_grad_enabled():
        return fire(point, x.clone())
    value = LazyCopies.of(x)
    new = fire(point, value)
    return x if new is value and not value.written() else plain(new)


def _seen(t: torch.Tensor) -> int | None:
    """t's version counter before its hooks run; None for an inference tensor (torch.inference_mode counts no
    writes)."""
    return None if t.is_inference() else t._version


def _unchanged(new, t: torch.Tensor, seen: int | None) -> bool:
    """Whether the hooks left t as it was: they returned t itself and wrote nothing into it (under inference mode a
    write cannot be seen, so t counts as written)."""
    return new is t and seen is not None and t._version == seen


def _editable(x: torch.Tensor, fns) -> torch.Tensor:
    """x for hooks `fns` to read or edit in place: under autograd a copy, since the kernel that made x (the softmax,
    SDPA) keeps it for the backward pass, which an edit in place would break; x itself otherwise."""
    return x.clone() if fns and torch.is_grad_enabled() and x.requires_grad else x


def _memo(memo: dict | None, key: tuple, make: Callable[[], Any]) -> Any:
    """memo[key], made by `make()` the first time (no memo: made every time). Keys name tensors by id(): the model's
    mask and ALiBi tensors, alive for the whole forward the memo lives in."""
    if memo is None:
        return make()
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _reusable(memo: dict, key: tuple, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """An empty tensor of `shape` (like's dtype and device) for one layer's output: the one memo[key] holds when its
    memory is referenced by nothing else (a hook that kept the value, or a view of it, holds it: then a new one)."""
    buf = memo.get(key)
    if buf is None or buf.shape != shape or buf.dtype != like.dtype or buf.device != like.device or \
            torch._C._storage_Use_Count(buf.untyped_storage()._cdata) > 2:  # this tensor and the wrapper asked
        buf = memo[key] = like.new_empty(shape)
    return buf


def _padded(mask) -> bool:
    """Whether the run's attention mask may hide every key of some query (padding, or a mask of transformers' own
    forms); without one, the causal mask always shows a query itself."""
    return mask is not None and (isinstance(mask, dict) or mask.dim() != 2 or not bool(mask.all()))


def _split(name: str) -> tuple[int, str]:
    parts = name.split(".", 2)
    return int(parts[1]), parts[2]


class HookedModel(TransformerLensSurface, TLWeights):
    """A supported Hugging Face causal LM with named hook points (see the module docstring), and TransformerLens
    3.9's model surface (`poslens.engine.tl_surface`, `poslens.engine.tl_weights`)."""

    def __init__(self, model, tokenizer=None) -> None:
        keep_freed_memory()  # the maps and per-head results a reader forms would fault in fresh pages every layer
        self.model = model
        self.tokenizer = tokenizer
        self._added: list[tuple] = []  # hooks added with add_hook: (name, fn, "fwd" | "bwd", permanent)
        self._contexts: dict[str, dict] = {}  # point name -> the dict TransformerLens hooks see as hook.ctx
        self._cfg: TLConfig | None = None
        self.family = family_of(model.config)
        self.layers = decoder_layers(model)
        self.n_layers = len(self.layers)
        if not self.layers:
            raise UsageError(f"this {self.family.name} model has no decoder layers (its config sets 0): give it at "
                             "least one")
        self._limit = position_limit(model)  # (what, n): the positions a table bounds, or None
        self.attns = [layer_attention(self.family, layer) for layer in self.layers]
        cfg = model.config
        self._heads = (cfg.num_attention_heads, kv_heads(cfg))
        self._inputs = self.family.per_head_inputs  # TransformerLens's per-head attention inputs exist here
        q_norm, k_norm = self.family.qk_norm_attrs
        inputs = input_points(*self._heads) if self._inputs else ()
        names = [block_points(self.family, qk_norm=hasattr(self.attns[0], q_norm), inputs=inputs,
                              moe=sparse_mlp(self.family, layer)) for layer in self.layers]
        embeds = ["hook_embed", *(["hook_pos_embed"] if self.family.pos_embed_attr else [])]
        if self.family.embed_norm_attr:  # BLOOM: TransformerLens's embed.ln, then hook_embed (its output)
            embeds = norm_points("embed.ln")[:2] + embeds
        self.points = embeds + [f"blocks.{l}.{p}" for l in range(self.n_layers) for p in names[l]] + \
            norm_points("ln_final") + ["unembed.hook_in", "unembed.hook_out"]
        self._use = {flag: False for flag in OPTIONAL.values()}
        self._set_tl_points()
        self._known = set(self.points)
        final = base_part(model, self.family.final_norm_attr)
        self._norms = {"ln_final": (final, None)}  # point prefix -> (norm module, layer)
        if self.family.embed_norm_attr:
            self._norms["embed.ln"] = (base_part(model, self.family.embed_norm_attr), None)
        for l, layer in enumerate(self.layers):
            for prefix, attr in self.family.norm_points.items():
                self._norms[f"blocks.{l}.{prefix}"] = (getattr(layer, attr), l)
            if hasattr(self.attns[l], q_norm):
                self._norms[f"blocks.{l}.attn.q_norm"] = (getattr(self.attns[l], q_norm), l)
                self._norms[f"blocks.{l}.attn.k_norm"] = (getattr(self.attns[l], k_norm), l)
        self._run: _Run | None = None

    def _set_tl_points(self) -> None:
        self.tl_points = [p for p in self.points if is_transformer_lens_name(p) and
                          self._use.get(OPTIONAL.get(p.split(".", 2)[-1], ""), True)]

    def set_use_attn_result(self, use_attn_result: bool) -> None:
        """Include attn.hook_result (each head's output after W_O, [B, T, H, d]) in run_with_cache's default and in
        names_filter functions, as TransformerLens's setting does (hooking it by name needs no setting)."""
        self._use["use_attn_result"] = bool(use_attn_result)
        self._set_tl_points()

    def set_use_hook_mlp_in(self, use_hook_mlp_in: bool) -> None:
        """Include hook_mlp_in (the MLP's input before ln2, a copy of hook_resid_mid) likewise."""
        self._use["use_hook_mlp_in"] = bool(use_hook_mlp_in)
        self._set_tl_points()

    def set_use_attn_in(self, use_attn_in: bool) -> None:
        """Include hook_attn_in (resid_pre copied per head, [B, T, H, d]) likewise; refused with grouped-query
        attention, as TransformerLens refuses it."""
        if use_attn_in and not self._inputs:
            raise UsageError(f"set_use_attn_in: not yet on {self.family.name} ({BUILT_ON})")
        if use_attn_in and self._heads[0] != self._heads[1]:
            raise UsageError(f"set_use_attn_in: {GQA_ATTN_IN}")
        self._use["use_attn_in"] = bool(use_attn_in)
        self._set_tl_points()

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """Include hook_q_input [B, T, H, d], hook_k_input and hook_v_input [B, T, K, d] likewise."""
        if use_split_qkv_input and not self._inputs:
            raise UsageError(f"set_use_split_qkv_input: not yet on {self.family.name} ({BUILT_ON})")
        self._use["use_split_qkv_input"] = bool(use_split_qkv_input)
        self._set_tl_points()

    @classmethod
    def from_pretrained(cls, spec: str, **load_kwargs) -> HookedModel:
        """The model and tokenizer `load_model(spec, **load_kwargs)` returns, hooked (TransformerLens's
        `HookedTransformer.from_pretrained`, without its weight processing). TransformerLens's own keywords are
        taken as it means them where poslens has their meaning (`torch_dtype`/`dtype`, `device`, `hf_model`,
        `tokenizer` as an object, `default_prepend_bos`, `default_padding_side`); its weight-processing switches
        (`fold_ln`, `center_writing_weights`, `center_unembed`, `fold_value_biases`,
        `refactor_factored_attn_matrices`) are accepted and change nothing: poslens never processes weights, and its
        `apply_ln_to_stack` applies the norm's gain so that products with W_U agree (docs/hooks.md, "Weights")."""
        from poslens.engine.models import load_model

        for flag in PROCESSING:
            load_kwargs.pop(flag, None)
        prepend = load_kwargs.pop("default_prepend_bos", None)
        side = load_kwargs.pop("default_padding_side", None)
        if "torch_dtype" in load_kwargs:
            load_kwargs["dtype"] = load_kwargs.pop("torch_dtype")
        hf_model = load_kwargs.pop("hf_model", None)
        given = not isinstance(load_kwargs.get("tokenizer", ""), str)  # a tokenizer object, as TransformerLens takes
        tokenizer = load_kwargs.pop("tokenizer") if given else None  # (a spec string goes to load_model)
        unknown = sorted(set(load_kwargs) - set(inspect.signature(load_model).parameters))
        if unknown:
            raise NoEquivalent(f"from_pretrained: TransformerLens's {unknown[0]}= has no poslens equivalent; the "
                               "keywords poslens takes are load_model's (docs/hooks.md, 'Coming from "
                               "TransformerLens')")
        if hf_model is not None:
            model = hf_model.eval()
        else:
            model, loaded = load_model(spec, **load_kwargs)
            tokenizer = tokenizer or loaded
        hooked = cls(model, tokenizer)
        if prepend is not None:
            hooked.cfg.default_prepend_bos = bool(prepend)
        if side is not None:
            if side not in ("left", "right") or tokenizer is None:
                raise UsageError(f"from_pretrained: default_padding_side must be 'left' or 'right' and needs a "
                                 f"tokenizer, got {side!r}")
            tokenizer.padding_side = side
        return hooked

    @classmethod
    def from_pretrained_no_processing(cls, spec: str, **load_kwargs) -> HookedModel:
        """TransformerLens's from_pretrained without weight processing: poslens's from_pretrained, which never
        processes weights."""
        return cls.from_pretrained(spec, **load_kwargs)

    @property
    def cfg(self) -> TLConfig:
        """TransformerLens's configuration fields of this model (n_layers, d_model, n_heads, d_head, n_ctx, ...)."""
        if self._cfg is None:
            self._cfg = tl_config(self.model, self.tokenizer)
        return self._cfg

    # ---- running ------------------------------------------------------------------------------------------

    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            hooks: dict[str, HookFn | list[HookFn]] | None = None, *, logits: bool = False,
            position_ids: torch.Tensor | None = None, **model_kwargs):
        """One forward under no_grad with `hooks` (point name -> function or list of functions).

        Returns the model's output (logits) when `logits=True`; otherwise the forward stops after the last hooked
        point and returns None. `model_kwargs` go to the model's forward (e.g. output_hidden_states=True).
        """
        if hooks is not None and not isinstance(hooks, dict):
            raise UsageError(f"hooks must be a dict point name -> function, got {type(hooks).__name__}")
        input_ids = self._check_ids(input_ids, "run")
        attention_mask = self._check_mask(input_ids, attention_mask)
        return self._forward(input_ids, attention_mask, self._check_hooks(hooks or {}), logits=logits,
                             position_ids=position_ids, grad=False, **model_kwargs)

    def _check_ids(self, input_ids, method: str) -> torch.Tensor:
        """Token ids [B, T] (a 1-D tensor gets a batch dimension), refused in one line unless the model can embed
        them."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.is_floating_point() or input_ids.is_complex() \
                or input_ids.dtype == torch.bool:
            raise UsageError(f"{method}: input_ids must be a tensor of integer token ids [batch, pos], got "
                             f"{getattr(input_ids, 'dtype', type(input_ids).__name__)}; tokenize text with the "
                             "model's tokenizer (or hm.to_tokens)")
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise UsageError(f"{method}: input_ids must be [batch, pos] (or [pos]), got shape {tuple(input_ids.shape)}")
        if input_ids.numel() == 0:
            raise UsageError(f"{method}: input_ids is empty (shape {tuple(input_ids.shape)}); give at least one token")
        vocab = self.model.get_input_embeddings().weight.shape[0]
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= vocab:
            raise UsageError(f"{method}: token id {low if low < 0 else high} is outside the model's vocabulary "
                             f"(0-{vocab - 1})")
        self.check_positions(input_ids.shape[1], method)
        return input_ids

    def check_positions(self, n: int, method: str, what: str = "tokens") -> None:
        """Refuse in one line a sequence of n positions past a table that bounds them (GPT-2's and OPT's position
        tables, GPT-J's sin/cos rows); positions computed on the fly (RoPE, ALiBi, NoPE) have no bound."""
        if self._limit is not None and n > self._limit[1]:
            raise UsageError(f"{method}: {n} positions are past the {self._limit[0]}; give at most "
                             f"{self._limit[1]} {what}")

    def _check_mask(self, input_ids: torch.Tensor, attention_mask):
        """The attention mask [B, T] of input_ids (1 = a real token), refused in one line unless it has their shape
        and holds only 0 and 1. transformers' own forms pass as the model takes them: a [B, 1, T, T'] mask whose
        query dimension is T, or a dict of them by layer type (`_explicit_mask`)."""
        if attention_mask is None:
            return attention_mask
        if isinstance(attention_mask, dict):
            return {kind: m if m is None else self._explicit_mask(input_ids, m) for kind, m in attention_mask.items()}
        if not isinstance(attention_mask, torch.Tensor):
            raise UsageError(f"attention_mask must be a tensor [batch, pos] of 0 and 1, got "
                             f"{type(attention_mask).__name__}")
        if attention_mask.dim() == 1 and input_ids.shape[0] == 1:
            attention_mask = attention_mask[None]
        if attention_mask.dim() == 4:
            return self._explicit_mask(input_ids, attention_mask)
        if tuple(attention_mask.shape) != tuple(input_ids.shape):
            raise UsageError(f"attention_mask has shape {tuple(attention_mask.shape)}, the token ids "
                             f"{tuple(input_ids.shape)}: it needs one entry per token (1 = real, 0 = padding)")
        if not bool(((attention_mask == 0) | (attention_mask == 1)).all()):
            raise UsageError("attention_mask must hold only 0 (padding) and 1 (a real token)")
        return attention_mask

    def _explicit_mask(self, input_ids: torch.Tensor, mask) -> torch.Tensor:
        """A 4-D mask [B or 1, 1, T, keys] in the form the model's attention takes. transformers passes a 4-D mask to
        the attention as given, and an eager attention (BLOOM's, Gemma-2's) adds it to the scores: a boolean mask
        (True = the key is seen) is made additive there (0 where seen, the dtype's minimum elsewhere), where added as
        given its False entries would hide nothing. A float mask is taken as additive (0 where seen, negative where
        hidden); an integer mask, or a float one with a positive entry (a 1/0 mask), is ambiguous and refused."""
        b, t = input_ids.shape
        if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[0] not in (1, b) \
                or mask.shape[-2] != t:
            raise UsageError(f"attention_mask has shape {tuple(getattr(mask, 'shape', ()))}: a 4-D mask must be "
                             f"[batch, 1, {t}, keys] for token ids {tuple(input_ids.shape)}")
        if mask.dtype != torch.bool and not (mask.is_floating_point() and not bool((mask > 0).any())):
            raise UsageError(f"attention_mask: a 4-D mask is boolean (True where a key is seen) or additive float (0 "
                             f"where seen, negative where hidden); got {mask.dtype} with values "
                             f"{mask.min().item():g} to {mask.max().item():g}")
        if mask.dtype == torch.bool and self.family.eager_output:
            return additive(mask, self.model.get_input_embeddings().weight.dtype)
        return mask

    def _forward(self, input_ids, attention_mask, by_point: dict[str, list[HookFn]], *, logits: bool,
                 position_ids, grad: bool, keys: int | None = None, **model_kwargs):
        """The forward with checked hooks (see run); with gradients when `grad`; `keys`: a cached generation step's
        sequence length so far (a sliding-window layer's cache holds fewer keys)."""
        per_layer: dict[int, dict[str, list[HookFn]]] = {}
        for name, fns in by_point.items():
            if name.startswith("blocks."):
                layer, point = _split(name)
                per_layer.setdefault(layer, {})[point] = fns
        head = logits or any(n.startswith("unembed.") for n in by_point)  # the LM head runs
        run = _Run(by_point, per_layer, set(by_point), head or not by_point, input_ids, attention_mask,
                   position_ids, keys=keys)
        if position_ids is None and self.family.pos_offset and attention_mask is not None \
                and (isinstance(attention_mask, dict) or attention_mask.dim() != 2):
            # OPT counts positions from a [B, T] mask; a 4-D (or per-layer) mask gets positions 0..T-1 given
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        with torch.set_grad_enabled(grad), self._installed(run):
            kwargs = {**dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             use_cache=False), **model_kwargs}  # generate's key/value cache: use_cache=True
            if head:
                out = self.model(**kwargs)
                return out if logits else None
            try:
                self.model.base_model(**kwargs)
            except _Stop:
                pass
        return None

    def __getattr__(self, name: str):
        """TransformerLens's other HookedTransformer attributes fail loudly, in one line, naming what to use where
        poslens has it; a name TransformerLens does not have either is an ordinary AttributeError."""
        if name.startswith("_"):
            raise AttributeError(name)
        prop = getattr(type(self), name, None)
        if isinstance(prop, property):  # a property that raised an AttributeError (W_pos's NoEquivalent): its own
            return prop.fget(self)
        if name not in TL_MODEL_NAMES and not hasattr(torch.nn.Module, name):
            raise AttributeError(f"HookedModel has no attribute {name!r} (nor has TransformerLens's HookedTransformer; "
                                 "docs/hooks.md lists what HookedModel has)")
        hint = MODEL_HINTS.get(name, "see docs/hooks.md, 'Coming from TransformerLens', for what HookedModel has")
        raise NoEquivalent(f"HookedModel has no {name!r}: TransformerLens's {name} has no poslens equivalent; {hint}")

    def check_point(self, name: str) -> None:
        """A one-line UsageError, with a hint, when the model has no hook point `name`."""
        self._check_name(name)

    def _check_name(self, name: str) -> None:
        if name in self._known:
            return
        parts = name.split(".")
        hint = "e.g. blocks.0.hook_resid_pre, blocks.0.attn.hook_q; see HookedModel.points"
        if name.startswith("blocks.") and len(parts) > 2 and parts[1].isdigit():
            if int(parts[1]) >= self.n_layers:
                hint = f"the model has {self.n_layers} layers (0-{self.n_layers - 1})"
            elif not self._inputs and ".".join(parts[2:]) in ("hook_attn_in", *input_points(*self._heads)):
                hint = (f"TransformerLens has it; poslens has the per-head inputs on {BUILT_ON}, not yet on "
                        f"{self.family.name}: read blocks.{parts[1]}.hook_resid_pre (the same value, once)")
            elif ".".join(parts[2:]) == "hook_attn_in":
                hint = GQA_ATTN_IN
            elif ".".join(parts[2:]) == "hook_resid_mid" and self.family.layout == "parallel":
                hint = ("attention and the MLP both read the stream entering a parallel block, so it has no resid_mid, "
                        "as in TransformerLens: read hook_resid_pre and hook_attn_out")
            elif ".".join(parts[2:]) in TL_ONLY:
                hint = f"TransformerLens has it, poslens has no equivalent: {TL_ONLY['.'.join(parts[2:])]}"
            elif parts[2] == "mlp" and (moe := sparse_mlp(self.family, self.layers[int(parts[1])])) is not None:
                n = moe.experts.num_experts
                hint = (f"layer {parts[1]}'s MLP is a mixture of {n} experts: its points are the router's "
                        f"(blocks.{parts[1]}.mlp.hook_expert_weights, hook_expert_indices) and each expert's "
                        f"(blocks.{parts[1]}.mlp.experts.{{0-{n - 1}}}.hook_gate, hook_pre, hook_post), as "
                        "TransformerLens's MoE")
        elif name in TL_ONLY:
            hint = f"TransformerLens has it, poslens has no equivalent: {TL_ONLY[name]}"
        elif name == "hook_pos_embed":
            hint = NO_POS_EMBED
        raise UsageError(f"hooks: no hook point {name!r} on this {self.family.name} model ({hint})")

    def _check_hooks(self, hooks: dict) -> dict[str, list[HookFn]]:
        out = {}
        for name, fns in hooks.items():
            self._check_name(name)
            fns = list(fns) if isinstance(fns, (list, tuple)) else [fns]
            if not all(callable(f) for f in fns):
                raise UsageError(f"hooks: the hook at {name!r} is not callable")
            out[name] = fns
        return out

    @contextmanager
    def _installed(self, run: _Run):
        """Everything a run needs, installed for its duration and removed after (also when it fails half-way)."""
        if self._run is not None:
            raise UsageError("this HookedModel is already running a forward (hooks cannot nest)")
        _register()
        undo: list[Callable[[], Any]] = []
        fns = run.by_point
        try:
            if not (self.family.alibi or self.family.own_attention):  # BLOOM's, Falcon's and GPT-Neo's attention are
                # own code (poslens's copies run them), not an interface
                saved = self.model.config._attn_implementation
                self.model.set_attn_implementation(ATTN_EAGER if self.family.eager_output else ATTN_SDPA)
                undo.append(lambda: self.model.set_attn_implementation(saved))
            handles = []
            if "hook_embed" in fns:  # BLOOM: on the norm after the embedding (TransformerLens's hook_embed)
                handles.append(base_part(self.model, self.family.embed_norm_attr or self.family.embed_attr)
                               .register_forward_hook(
                    lambda module, args, out: self._fire("hook_embed", None, out, fns["hook_embed"])))
            if "hook_pos_embed" in fns:
                handles.append(base_part(self.model, self.family.pos_embed_attr).register_forward_hook(
                    self._pos_embed_hook(run.input_ids.shape[0], fns["hook_pos_embed"])))
            head = self.model.get_output_embeddings()
            if "unembed.hook_in" in fns:
                handles.append(head.register_forward_pre_hook(
                    lambda module, args: (self._fire("unembed.hook_in", None, args[0], fns["unembed.hook_in"]),)))
            if "unembed.hook_out" in fns:
                handles.append(head.register_forward_hook(
                    lambda module, args, out: self._fire("unembed.hook_out", None, out, fns["unembed.hook_out"])))
            mask = run.attention_mask
            if self.family.alibi_from_mask and self.family.alibi and mask is not None and (
                    isinstance(mask, dict) or mask.dim() != 2):
                # BLOOM builds ALiBi from a [B, T] mask: with a 4-D one (an explicit window), from all-ones keys
                base, keys = self.model.base_model, torch.ones_like(run.input_ids)
                previous, build = base.__dict__.get("build_alibi_tensor"), alibi_builder(base)  # (a scaling's)
                base.build_alibi_tensor = lambda m, heads, dtype: build(keys, heads, dtype)
                undo.append(lambda: setattr(base, "build_alibi_tensor", previous) if previous is not None
                            else delattr(base, "build_alibi_tensor"))
            clip = getattr(self.model.config, "clip_qkv", None) if self.family.clip_qkv_in_place else None
            if clip is not None:  # OLMo's in-place clamp of q, k, v after their projections: the hooks' instead
                self.model.config.clip_qkv = None
                undo.append(lambda: setattr(self.model.config, "clip_qkv", clip))
            projection_hooks = self._named_projection_hooks if self.family.proj else functools.partial(
                self._projection_hooks, clip=clip)
            for l in range(len(self.layers)):
                if l in run.per_layer:
                    handles += projection_hooks(l, run.per_layer[l])
                elif clip is not None:
                    handles += self._clamp_hooks(l, clip)
            undo += [h.remove for h in handles]
            for prefix, (module, layer) in self._norms.items():
                if any(p in fns for p in norm_points(prefix)) and not self._shared_ln2(prefix):
                    module.forward = functools.partial(self._norm, module, prefix, layer)
                    undo.append(lambda m=module: delattr(m, "forward"))  # back to the class's forward
            for layer, attn in zip(self.layers, self.attns):
                setattr(layer, _OWNER, self)
                setattr(attn, _OWNER, self)
                layer.forward = types.MethodType(_block_forward, layer)
                undo.append(lambda m=layer, a=attn: [delattr(m, "forward"), delattr(m, _OWNER), delattr(a, _OWNER)])
            self._run = run
            yield
        finally:
            self._run = None
            for fn in reversed(undo):
                fn()

    def _clamp_hooks(self, l: int, clip: float) -> list:
        """OLMo's clip_qkv as forward hooks on layer l's q, k and v projections: their outputs clamped to [-clip, clip]
        (out of place, the values the model's in-place clamp gives), so that attn.hook_q/k/v, whose hooks fire after
        these, see and replace the clamped projections (the model's own clamp is off while a HookedModel runs)."""
        attn = self.attns[l]
        return [m.register_forward_hook(lambda module, args, out: out.clamp(-clip, clip))
                for m in (attn.q_proj, attn.k_proj, attn.v_proj)]

    def _projection_hooks(self, l: int, pts: dict, clip: float | None = None) -> list:
        """Module hooks for the hooked projection points of layer l: q, k, v (Phi-3: one fused qkv_proj; GPT-2: one
        Conv1D c_attn), the MLP's gate and up (Phi-3: one fused gate_up_proj; GPT-2: c_fc, no gate) and the down
        projection's input; `clip` (OLMo's clip_qkv): the clamp after the per-head inputs' projections, before the
        points."""
        attn, mlp, cfg = self.attns[l], mlp_module(self.family, self.layers[l]), self.model.config
        d, heads, kv = attn.head_dim, cfg.num_attention_heads, kv_heads(cfg)
        sparse = sparse_mlp(self.family, self.layers[l]) is not None  # its MLP's points fire in `_moe`
        qkv = [("attn.hook_q", heads * d, d), ("attn.hook_k", kv * d, d), ("attn.hook_v", kv * d, d)]
        if hasattr(attn, "c_attn"):
            o_proj, down = attn.c_proj, mlp.c_proj
        elif self.family.mlp_seq:  # OPT: out_proj, the layer's fc1, fc2; BLOOM: dense, dense_h_to_4h, dense_4h_to_h
            o_proj, down = getattr(attn, "out_proj", None) or attn.dense, getattr(mlp, self.family.mlp_seq[2])
        elif sparse:
            o_proj, down = attn.o_proj, None
        else:  # (Starcoder2's MLP: c_fc, c_proj)
            o_proj, down = attn.o_proj, getattr(mlp, "down_proj", None) or mlp.c_proj
        width = 0 if sparse else down.weight.shape[0] if type(down).__name__ == "Conv1D" else down.in_features
        gate_up = [("mlp.hook_pre", width, 0), ("mlp.hook_pre_linear", width, 0)]  # (GPT-2's Conv1D: [in, out])
        # the q/k/v projections and the parts of their outputs: GPT-2's one Conv1D c_attn, GPT-BigCode's one Linear
        # c_attn [q heads | k | v] (multi-query), Phi-3's qkv_proj and MPT's Wqkv [q | k | v]; a projection with each
        # head's [q | k | v] (BLOOM, multi-head GPT-BigCode) is `_per_head_qkv_hooks`'s
        if self.family.qkv_per_head:
            attn_sites = []
        else:
            fused = next((getattr(attn, n) for n in ("c_attn", "qkv_proj", "Wqkv") if hasattr(attn, n)), None)
            attn_sites = [(fused, qkv)] if fused is not None else [
                (attn.q_proj, qkv[:1]), (attn.k_proj, qkv[1:2]), (attn.v_proj, qkv[2:])]
        sites = [] if self.family.own_attention else list(attn_sites)  # MPT: q, k and v fire in `_mpt_attention`
        if sparse:  # no projection hooks: a sparse layer's MLP points fire in `_moe`
            pass
        elif hasattr(mlp, "c_fc"):  # GPT-2, GPT-BigCode: the MLP's one up projection
            sites.append((mlp.c_fc, gate_up[:1]))
        elif self.family.mlp_seq:  # OPT, BLOOM: one up projection
            sites.append((getattr(mlp, self.family.mlp_seq[0]), gate_up[:1]))
        elif hasattr(mlp, "gate_up_proj"):
            sites.append((mlp.gate_up_proj, gate_up))
        elif hasattr(mlp, "gate_proj"):
            sites += [(mlp.gate_proj, gate_up[:1]), (mlp.up_proj, gate_up[1:])]
        handles = []
        # first: attn.hook_q/k/v see the projected copies of the per-head inputs
        if self._inputs and any(p in pts for p in input_points(*self._heads)):
            handles += [module.register_forward_hook(input_projection_hook(lambda: self._run.inputs.get(l), parts))
                        for module, parts in attn_sites]  # (MPT's Wqkv: then the copy's clamp, split and points)
        if clip is not None:
            handles += self._clamp_hooks(l, clip)
        handles += [module.register_forward_hook(self._split_hook(l, parts))
                    for module, parts in sites if any(p in pts for p, _, _ in parts)]
        return handles + self._per_head_qkv_hooks(l, pts, attn, heads, d) + self._output_hooks(l, pts, o_proj, down,
                                                                                              heads)

    def _output_hooks(self, l: int, pts: dict, o_proj, down, heads: int) -> list:
        """Module hooks for attn.hook_result (on W_O) and mlp.hook_post (the down projection's input) of layer l."""
        handles = []
        if "attn.hook_result" in pts:  # W_O's forward replaced for the run (handle.remove() puts the class's back)
            o_proj.forward = functools.partial(self._heads_out, l, heads, o_proj)
            handles.append(_Replaced(o_proj))
        if "mlp.hook_post" in pts:
            def post(module, args):
                new = self._fire_at(l, "mlp.hook_post", args[0])
                return None if new is args[0] else (new,)

            handles.append(down.register_forward_pre_hook(post))
        return handles

    def _named_projection_hooks(self, l: int, pts: dict) -> list:
        """Module hooks for the hooked projection points of layer l on a family whose projections the registry names
        (Family.proj: GPT-NeoX, GPT-J, Phi, Falcon): q, k, v (separate, or GPT-NeoX's fused per-head query_key_value;
        Falcon's fire in `_falcon_attention`) with the per-head inputs' projections first, the MLP's one up projection
        (mlp.hook_pre: no gate), W_O's heads and the down projection's input."""
        attn, mlp, cfg = self.attns[l], self.layers[l].mlp, self.model.config
        o_name, up_name, down_name = self.family.proj
        d, heads = head_dim(attn), cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        handles = []
        inputs = self._inputs and any(p in pts for p in input_points(*self._heads))
        if self.family.qkv_per_head:
            handles += self._per_head_qkv_hooks(l, pts, attn, heads, d)
        elif self.family.own_attention == "falcon":  # q, k and v fire in `_falcon_attention`; the per-head inputs here
            if inputs:
                handles.append(attn.query_key_value.register_forward_hook(self._falcon_input_hook(l, attn)))
        else:
            for module, part in ((attn.q_proj, ("attn.hook_q", heads * d, d)),
                                 (attn.k_proj, ("attn.hook_k", kv * d, d)), (attn.v_proj, ("attn.hook_v", kv * d, d))):
                if inputs:  # first: the projected copies of the per-head inputs
                    handles.append(module.register_forward_hook(
                        input_projection_hook(lambda: self._run.inputs.get(l), [part])))
                if part[0] in pts:
                    handles.append(module.register_forward_hook(self._split_hook(l, [part])))
        if "mlp.hook_pre" in pts:
            handles.append(getattr(mlp, up_name).register_forward_hook(self._split_hook(l, [("mlp.hook_pre", 0, 0)])))
        return handles + self._output_hooks(l, pts, getattr(attn, o_name), getattr(mlp, down_name), heads)

    def _per_head_qkv_hooks(self, l: int, pts: dict, attn, heads: int, d: int) -> list:
        """The forward hook on a per-head fused projection (Family.qkv_per_head: GPT-NeoX's and BLOOM's
        query_key_value), whose output holds each head's [q | k | v] side by side ([B, T, H * 3 * D]), when layer l
        hooks q, k or v: attn.hook_q, hook_k and hook_v fire as [B, T, H, D] views of it (an edit in place edits the
        output); a replacement is written back in the same layout. Registered first, where layer l hooks a per-head
        input, the written copies' projections (`tl_inputs.per_head_input_projection_hook`). [] when nothing is hooked
        or the family has none."""
        points = ("attn.hook_q", "attn.hook_k", "attn.hook_v")
        if not self.family.qkv_per_head:
            return []
        fused = getattr(attn, self.family.qkv_per_head)
        handles = []
        if self._inputs and any(p in pts for p in input_points(*self._heads)):  # first: the written per-head inputs
            handles.append(fused.register_forward_hook(
                per_head_input_projection_hook(lambda: self._run.inputs.get(l), heads, d)))
        if not any(p in pts for p in points):
            return handles

        def hook(module, args, out):
            fused = out.unflatten(-1, (heads, 3, d))  # q, k, v: [B, T, H, D] views, one `select` each (autograd
            views = [fused.select(-2, i) for i in range(3)]  # lets a hook edit those in place, not unbind's)
            new = [self._fire_at(l, point, x) for point, x in zip(points, views)]
            if all(y is x for x, y in zip(views, new)):
                return None
            return torch.stack(new, -2).flatten(-3)

        return handles + [fused.register_forward_hook(hook)]

    def _falcon_input_hook(self, l: int, attn):
        """The per-head inputs' projection on Falcon's query_key_value: [q heads | k | v] with multi_query (one
        key/value head), each head's [q | k | v] side by side without."""
        d, heads, kv = attn.head_dim, attn.num_heads, attn.num_kv_heads
        if attn.new_decoder_architecture:  # K groups of (H/K query heads, k, v)
            return per_head_input_projection_hook(lambda: self._run.inputs.get(l), heads, d, kv)
        if not attn.multi_query:
            return per_head_input_projection_hook(lambda: self._run.inputs.get(l), heads, d)
        return input_projection_hook(lambda: self._run.inputs.get(l), [
            ("attn.hook_q", heads * d, d), ("attn.hook_k", kv * d, d), ("attn.hook_v", kv * d, d)])

    def _shared_ln2(self, prefix: str) -> bool:
        """Whether `prefix` is the ln2 of a family where one norm feeds attention and the MLP (GPT-J, Phi): its points
        are fired by the block forward, not by replacing the module's forward (which is ln1's)."""
        fam = self.family
        return fam.layout == "parallel" and fam.ln2 == fam.ln1 and prefix.endswith(".ln2")

    # ---- firing -------------------------------------------------------------------------------------------

    def _ctx(self, name: str, layer: int | None, **attn) -> HookContext:
        run = self._run
        return HookContext(name, layer, run.input_ids, run.attention_mask, run.position_ids, **attn)

    def _fire(self, name: str, layer: int | None, x, fns: list[HookFn] | None, ctx: HookContext | None = None):
        """Call the hooks of one point in order; a returned tensor replaces x. Then stop if no hooked point is left."""
        if not fns:
            return x
        ctx = ctx or self._ctx(name, layer)
        for fn in fns:
            out = fn(x, ctx)
            if out is not None:
                if not isinstance(out, torch.Tensor) or out.shape != x.shape:
                    raise UsageError(f"hook at {name}: a replacement must be a tensor of shape "
                                     f"{tuple(x.shape)}, got {getattr(out, 'shape', type(out).__name__)}")
                x = out.to(x.dtype)
        self._fired(name)
        return x

    def _fired(self, name: str) -> None:
        run = self._run
        run.pending.discard(name)
        if not run.pending and not run.to_end:
            raise _Stop

    def _fire_at(self, l: int, point: str, x):
        """Fire the point `point` of layer l (a no-op when it has no hooks)."""
        fns = self._run.per_layer.get(l, {}).get(point)
        return self._fire(f"blocks.{l}.{point}", l, x, fns) if fns else x

    def _heads_out(self, l: int, heads: int, module, z: torch.Tensor) -> torch.Tensor:
        """W_O with attn.hook_result: each head's output z_h W_O[h] ([B, T, H, d], one batched GEMM over the heads)
        fired, then attention's output is their sum plus W_O's bias, as TransformerLens computes it with
        use_attn_result: the values read are the ones summed (W_O's own product does not run; the logits are within
        float32 rounding of the plain forward's)."""
        w = module.weight if type(module).__name__ == "Conv1D" else module.weight.T  # [H*D, d]
        zh, wh = z.reshape(-1, heads, w.shape[0] // heads).transpose(0, 1), w.unflatten(0, (heads, -1))
        if torch.is_grad_enabled() and (zh.requires_grad or wh.requires_grad):
            per_head = torch.bmm(zh, wh)  # [H, B*T, d]: one batched GEMM over the heads
        else:  # into the layer before's buffer when no hook kept it (above 32 MiB glibc maps and unmaps each one)
            per_head = torch.bmm(zh, wh, out=_reusable(self._run.hidden, ("per-head results",),
                                                       (heads, zh.shape[1], w.shape[1]), zh))
        result = per_head.view(heads, *z.shape[:-1], -1).movedim(0, -2)  # [B, T, H, d], a view
        out = self._fire_at(l, "attn.hook_result", result).sum(-2)  # [B, T, d]
        if module.bias is None:
            return out
        return out + module.bias if torch.is_grad_enabled() else out.add_(module.bias)

    def _split_hook(self, l: int, parts: list[tuple[str, int, int]]):
        """A forward hook on a projection whose output holds `parts` side by side, each (point, width, head width or
        0): every hooked part is fired ([B, T, heads, D] when it has heads) and written back."""
        def hook(module, args, out):
            pieces = _side_by_side(out, [w for _, w, _ in parts]) if len(parts) > 1 else (out,)
            new = []
            for (point, _, d), piece in zip(parts, pieces):
                x = piece.unflatten(-1, (-1, d)) if d else piece
                y = self._fire_at(l, point, x)
                new.append(piece if y is x else y.flatten(-2) if d else y)
            if all(a is b for a, b in zip(new, pieces)):
                return None
            return torch.cat(new, -1) if len(new) > 1 else new[0]

        return hook

    def _pos_embed_hook(self, batch: int, fns: list[HookFn]):
        """A forward hook on the position table firing hook_pos_embed, its rows at the positions as [B, T, d] (the model
        looks them up once for the batch, [1, T, d]: copied per row, as TransformerLens's lookup, so that a hook can
        edit one row in place); unless a hook wrote them, the model's own output stays."""
        def hook(module, args, out):
            x = out.expand(batch, -1, -1).clone() if out.shape[0] != batch else out
            seen = _seen(x)
            new = self._fire("hook_pos_embed", None, x, fns)
            return None if _unchanged(new, x, seen) else new

        return hook

    def _layer_norm(self, module, prefix: str, layer: int | None, x: torch.Tensor,
                    given: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """LayerNorm with TransformerLens's points: scale sqrt(var(x) + eps) and normalized (x - mean) / scale (float32,
        before the gain and bias), then the output. Unless a hook replaced the scale or the normalized value, the output
        is the module's own (bit-identical); else normalized * w + b. `given`: (scale, normalized, output) of this norm
        on the same x, already computed and untouched (GPT-J's and Phi's ln2, which is their ln1 again): the hooks get
        `LazyCopies` of them instead of a second computation (the same floats; copied only if a hook writes). A per-head
        q/k LayerNorm (Cohere's, StableLM's) shows TransformerLens's flattened layout [B*T*heads, .], as the RMSNorm
        q/k norms (`_norm`)."""
        fns = self._run.by_point
        flat = prefix.endswith(("q_norm", "k_norm"))
        heads_first = flat and self.family.qk_norm_heads_first  # StableLM's q/k norms read [B, heads, T, D]

        def fire(point: str, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
            name = f"{prefix}.{point}"
            if name not in fns:
                return t, False
            if flat:  # TransformerLens's [B*T*heads, .]: a view of [B, T, heads, .], a copy of heads-first values
                tl = t.transpose(1, 2) if heads_first else t
                view = tl.reshape(-1, t.shape[-1])
                seen = _seen(view)
                new = self._fire(name, layer, view, fns[name])
                if _unchanged(new, view, seen):
                    return t, False
                if new is view and _shares(view, t):  # edited in place through a view: t holds the edit
                    return t, True
                new = new.reshape(tl.shape)
                return (new.transpose(1, 2) if heads_first else new), True
            seen = _seen(t)
            new = self._fire(name, layer, t, fns[name])
            if isinstance(t, LazyCopies):
                return plain(new), new is not t or t.written()
            return new, not _unchanged(new, t, seen)

        changed, hooked = False, f"{prefix}.hook_scale" in fns or f"{prefix}.hook_normalized" in fns
        if hooked and given is not None:
            scale, changed = fire("hook_scale", LazyCopies.of(given[0]))
            if changed:  # a new scale: normalized from it, as below
                x32 = x.float()
                normalized = (x32 - x32.mean(-1, keepdim=True)) / scale
            else:
                normalized = LazyCopies.of(given[1])
            normalized, written = fire("hook_normalized", normalized)
            changed |= written
        elif hooked and torch.is_grad_enabled() and x.requires_grad:  # autograd: TransformerLens's steps, so that
            # gradients reach the scale and the normalized value (backward hooks, incl_bwd) and the output is theirs
            x32 = x.float()
            centred = x32 - x32.mean(-1, keepdim=True)
            scale, _ = fire("hook_scale", (centred.pow(2).mean(-1, keepdim=True) + norm_eps(module)).sqrt())
            normalized, _ = fire("hook_normalized", centred / scale)
            changed = True
        elif hooked:  # (x - mean) / sqrt(var + eps) in one fused pass, with the mean and 1 / sqrt(var + eps) [B, T, 1]
            x32 = x.float()
            normalized, mean, rstd = torch.native_layer_norm(x32, x.shape[-1:], None, None, norm_eps(module))
            scale, changed = fire("hook_scale", rstd.reciprocal())
            if changed:  # a new scale: normalized from it
                normalized = (x32 - mean) / scale
            normalized, written = fire("hook_normalized", normalized)
            changed |= written
        if changed:
            weight, bias = norm_affine(module)  # (OLMo's LayerNorm: neither; MPT's: no bias)
            if heads_first:  # StableLM's per-head weights [heads, D] on [B, heads, T, D]
                weight, bias = (None if w is None else w[:, None] for w in (weight, bias))
            out = normalized if weight is None else normalized * weight.float()
            out = (out if bias is None else out + bias.float()).to(x.dtype)
        elif given is not None:
            out = given[2]
        else:
            out = type(module).forward(module, x)
        new, written = fire("hook_out", LazyCopies.of(out) if given is not None and not changed else out)
        if hooked and not (changed or written) and self._shared_ln1(prefix) and not torch.is_grad_enabled():
            self._run.shared_norm[layer] = (scale, normalized, out)  # for ln2's points (`_parallel_block`)
        return new if written else out

    def _shared_ln1(self, prefix: str) -> bool:
        """Whether `prefix` is the ln1 of a family where one norm feeds attention and the MLP (GPT-J, Phi)."""
        fam = self.family
        return fam.layout == "parallel" and fam.ln2 == fam.ln1 and prefix.endswith(".ln1")

    def _norm(self, module, prefix: str, layer: int | None, x: torch.Tensor,
              given: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
        """The family's RMSNorm (the model's own operations, so outputs stay bit-identical) with its points:
        TransformerLens's scale sqrt(mean(x^2) + eps) and normalized x / scale (float32, before the gain), and the
        output after the gain. q/k norms show TransformerLens's flattened layout [B*T*heads, .]. A LayerNorm family
        goes to `_layer_norm` (with `given`)."""
        if self.family.norm_kind == "layer":
            return self._layer_norm(module, prefix, layer, x, given)
        flat = prefix.endswith(("q_norm", "k_norm")) and not self.family.qk_norm_whole  # OLMo-2's: [B, T, H*D]
        heads_first = flat and self.family.qk_norm_heads_first  # Gemma-3 norms [B, heads, T, D]
        fns = self._run.by_point

        def fire(point: str, t: torch.Tensor) -> torch.Tensor:
            name = f"{prefix}.{point}"
            if name not in fns:
                return t
            tl = t.transpose(1, 2) if heads_first else t  # TransformerLens flattens [B, T, heads, .]
            view = tl.reshape(-1, t.shape[-1]) if flat else t  # Gemma-3's q/k norms: a copy, not a view
            seen = _seen(view)
            new = self._fire(name, layer, view, fns[name])
            if _unchanged(new, view, seen) or (new is view and _shares(view, t)):  # read, or edited through a view
                return t
            return new.reshape(tl.shape).transpose(1, 2) if heads_first else new.reshape(t.shape)

        x32 = x.float()
        var = x32.pow(2).mean(-1, keepdim=True)
        eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
        inv = torch.rsqrt(var + eps)
        if f"{prefix}.hook_scale" in fns:
            scale = torch.sqrt(var + eps)
            seen = _seen(scale)
            new = fire("hook_scale", scale)
            if not _unchanged(new, scale, seen):  # replaced, or edited in place
                inv = 1.0 / new
        normalized = fire("hook_normalized", x32 * inv)
        if self.family.norm_gain == "1+weight":  # Gemma: (1 + w) in float32, then the model's dtype
            out = (normalized * (1.0 + module.weight.float())).type_as(x)
        elif self.family.norm_gain == "weight-float32":  # OLMo-2: w times the float32 value, then the model's dtype
            out = (module.weight * normalized).to(x.dtype)
        else:  # Llama: the model's dtype first, then w
            out = module.weight * normalized.to(x.dtype)
        return fire("hook_out", out)

    def _block(self, layer_mod, l: int, hidden_states: torch.Tensor, attn_kwargs: dict) -> torch.Tensor:
        """The decoder block with its residual-stream points (the model's own modules, in the model's order)."""
        fam = self.family
        if fam.layout == "parallel":
            return self._parallel_block(layer_mod, l, hidden_states, attn_kwargs)

        def fire(point: str, x):
            return self._fire_at(l, point, x)

        post = fam.layout == "post-norm"  # OLMo-2: x + norm(attn(x)), x + norm(mlp(x)); ln1, ln2 after the sublayers
        x = fire("hook_resid_pre", hidden_states)  # [B, T, d]
        if self._inputs:  # TransformerLens's per-head inputs (hook_attn_in, hook_q_input, ...): the written ones
            self._run.inputs[l] = fire_inputs(fire, self._run.per_layer.get(l, {}), x, getattr(layer_mod, fam.ln1),
                                              *self._heads)
        attn_in = x if post else getattr(layer_mod, fam.ln1)(x)  # ln1.*
        a = self._attention_of(layer_mod, attn_in, attn_kwargs)  # attn.*
        a = fire("attn.hook_out", a)  # [B, T, d] after W_O
        if fam.layout == "sandwich":  # Gemma: x + norm(attn(norm(x))), x + norm(mlp(norm(x)))
            a = getattr(layer_mod, fam.ln1_post)(a)  # ln1_post.*
        elif post:
            a = getattr(layer_mod, fam.ln1)(a)  # ln1.*
        a = fire("hook_attn_out", a)  # [B, T, d] what is added
        drop_attn = getattr(layer_mod, "resid_attn_dropout", None)  # Phi-3's residual dropouts: identities in eval
        x = fire("hook_resid_mid", x + (drop_attn(a) if drop_attn is not None else a))  # [B, T, d]
        # TransformerLens's hook_mlp_in: a copy of the stream that only the MLP reads (a write leaves the residual)
        mlp_in = _copy_point(fire, "hook_mlp_in", x) if "hook_mlp_in" in self._run.per_layer.get(l, {}) else x
        m = fire("mlp.hook_out", self._mlp(layer_mod, l, mlp_in if post else getattr(layer_mod, fam.ln2)(mlp_in)))
        if fam.layout == "sandwich":
            m = getattr(layer_mod, fam.ln2_post)(m)  # ln2_post.*
        elif post:
            m = getattr(layer_mod, fam.ln2)(m)  # ln2.*
        m = fire("hook_mlp_out", m)  # [B, T, d] what is added
        drop_mlp = getattr(layer_mod, "resid_mlp_dropout", None)
        return fire("hook_resid_post", x + (drop_mlp(m) if drop_mlp is not None else m))  # [B, T, d]

    def _mlp(self, layer_mod, l: int, x: torch.Tensor) -> torch.Tensor:
        """The MLP sublayer of layer l on x [B, T, d]: the model's module, or on a mixture-of-experts layer whose
        router, expert or shared-expert points are hooked, `_moe`."""
        block = sparse_mlp(self.family, layer_mod)
        pts = self._run.per_layer.get(l, {})
        if block is not None and any(p.startswith("mlp.") and p != "mlp.hook_out" for p in pts):
            return self._moe(l, block, x)
        return mlp_block(self.family, layer_mod)(x)

    def _moe(self, l: int, block, x: torch.Tensor) -> torch.Tensor:
        """A mixture-of-experts MLP with its points, the model's operations in the model's order (transformers 5's
        router, its experts kernel, Qwen2-MoE's shared expert through its sigmoid gate). N = B * T tokens,
        E experts, k chosen per token, n_e the tokens routed to expert e (in the model's order: by choice slot, then
        token), as TransformerLens's MoE:

            mlp.hook_expert_weights      [N, E] float32  softmax of the router's logits over all experts, before the
                                                         top k (a write: the top k of the written weights are chosen)
            mlp.hook_expert_indices      [N, k]          the experts chosen (a write reroutes, same weights)
            mlp.experts.{e}.hook_gate    [n_e, M]        expert e's gate projection of its tokens, before act
            mlp.experts.{e}.hook_pre     [n_e, M]        its up projection
            mlp.experts.{e}.hook_post    [n_e, M]        act(gate) * pre: its down projection's input
            mlp.shared_expert.hook_*     [B, T, M]       Qwen2-MoE's shared expert, as a dense MLP's points

        An expert no token chose fires on [0, M] (as TransformerLens's). Where no expert point is hooked the model's
        own experts module runs (the implementation it was loaded with); where one is, a copy of the model's kernel:
        transformers' grouped_mm (`_grouped_experts`) or its eager loop (`_experts`; any other kernel too, within
        rounding)."""
        pts = self._run.per_layer.get(l, {})
        B, T, d = x.shape
        h = x.view(-1, d)  # [N, d]
        shared = getattr(block, "shared_expert", None)
        if shared is not None:  # Qwen2-MoE: computed first, as the model does
            s = self._shared_expert(l, shared, x).view(-1, d)
        logits, weights, chosen = block.gate(h)  # [N, E], [N, k] (Mixtral: float32), [N, k]
        if "mlp.hook_expert_weights" in pts:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)  # the router's softmax
            seen = _seen(probs)
            new = self._fire_at(l, "mlp.hook_expert_weights", probs)
            if not _unchanged(new, probs, seen):  # written: route by the written weights, as the router would
                top, chosen = torch.topk(new, block.gate.top_k, dim=-1)
                if getattr(block.gate, "norm_topk_prob", True):  # Mixtral's router always renormalises
                    top = top / top.sum(dim=-1, keepdim=True)
                weights = top.to(weights.dtype)
        chosen = self._fire_at(l, "mlp.hook_expert_indices", chosen)
        if any(p.startswith("mlp.experts.") for p in pts):  # the model's kernel, copied with the points
            grouped = getattr(self.model.config, "_experts_implementation", None) == "grouped_mm"
            out = (self._grouped_experts if grouped else self._experts)(l, block.experts, h, chosen, weights)
        else:
            out = block.experts(h, chosen, weights)
        if shared is not None:
            out = out + torch.sigmoid(block.shared_expert_gate(h)) * s
        return out.reshape(B, T, d)

    def _experts(self, l: int, experts, h: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The experts' sum over the tokens routed to each, with their points (`_moe`): transformers' eager loop."""
        out = torch.zeros_like(h)
        routed = torch.nn.functional.one_hot(chosen, num_classes=experts.num_experts).permute(2, 1, 0)  # [E, k, N]
        for e in range(experts.num_experts):
            slot, token = torch.where(routed[e])
            fused = torch.nn.functional.linear(h[token], experts.gate_up_proj[e])  # [n_e, 2M]: [gate | up]
            views = _side_by_side(fused, [fused.shape[-1] // 2] * 2)  # [n_e, M] each (the model's chunk)
            gate, up = (self._fire_at(l, f"mlp.experts.{e}.{p}", v) for p, v in zip(("hook_gate", "hook_pre"), views))
            if gate is not views[0] or up is not views[1]:  # replaced: side by side again, so that the activation
                fused = torch.cat([gate, up], -1)  # reads the layout it reads unhooked (its kernel's rounding
                gate, up = _side_by_side(fused, [gate.shape[-1]] * 2)  # depends on it)
            post = self._fire_at(l, f"mlp.experts.{e}.hook_post", experts.act_fn(gate) * up)
            if token.numel():
                y = torch.nn.functional.linear(post, experts.down_proj[e]) * weights[token, slot, None]
                out.index_add_(0, token, y.to(out.dtype))
        return out

    def _grouped_experts(self, l: int, experts, h: torch.Tensor, chosen: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
        """The experts' sum with their points (`_moe`), as transformers' grouped_mm kernel computes it (its default):
        the N*k (token, choice) pairs grouped by expert, one grouped GEMM for every expert's gate and up projections and
        one for the down projections, the weighted rows put back in order and summed per token. Within each expert the
        rows are in TransformerLens's order (by slot, then token: a stable sort of the pairs taken slot by slot), so an
        expert's points are views of its rows; every row is the product the model's kernel forms for that pair (a
        GEMM's row does not depend on the rows beside it; the tests compare the logits bit for bit)."""
        from transformers.integrations.moe import _grouped_linear

        k, n, count = chosen.shape[-1], h.shape[0], experts.num_experts
        ids, pair = torch.sort(chosen.T.reshape(-1), stable=True)  # [S = N*k]: pair = slot * N + token, by expert
        token, slot = pair % n, pair // n
        rows = h[token]  # [S, d]
        per_expert = torch.histc(ids.float() if h.device.type in ("cpu", "mps") else ids.int(), bins=count, min=0,
                                 max=count - 1)
        offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)
        fused = _grouped_linear(rows, experts.gate_up_proj, offsets, is_transposed=experts.is_transposed)  # [S, 2M]
        gate, up = _side_by_side(fused, [fused.shape[-1] // 2] * 2)  # the model's chunk: [S, M] each
        ends = offsets.tolist()
        spans = list(zip([0, *ends[:-1]], ends))

        def fire(point: str, values: torch.Tensor) -> torch.Tensor:
            """Each expert's rows of `values` fired as a view; a replacement written into them."""
            for e, (a, b) in enumerate(spans):
                x = values[a:b]
                new = self._fire_at(l, f"mlp.experts.{e}.{point}", x)
                if new is not x:
                    x.copy_(new)
            return values

        gate, up = fire("hook_gate", gate), fire("hook_pre", up)
        post = fire("hook_post", experts.act_fn(gate) * up)  # [S, M]
        out = _grouped_linear(post, experts.down_proj, offsets, is_transposed=experts.is_transposed)  # [S, d]
        out = out * weights[token, slot][:, None]
        back = torch.empty_like(pair)
        back[token * k + slot] = torch.arange(pair.shape[0], device=pair.device)  # each (token, slot)'s row
        return out[back].view(n, k, -1).sum(dim=1).to(h.dtype)

    def _shared_expert(self, l: int, mlp, x: torch.Tensor) -> torch.Tensor:
        """Qwen2-MoE's shared expert on x [B, T, d], down(act(gate(x)) * up(x)), with its points."""
        gate = self._fire_at(l, "mlp.shared_expert.hook_pre", mlp.gate_proj(x))  # [B, T, M]
        up = self._fire_at(l, "mlp.shared_expert.hook_pre_linear", mlp.up_proj(x))
        return mlp.down_proj(self._fire_at(l, "mlp.shared_expert.hook_post", mlp.act_fn(gate) * up))

    def _parallel_block(self, layer_mod, l: int, hidden_states: torch.Tensor, attn_kwargs: dict) -> torch.Tensor:
        """GPT-NeoX, GPT-J, Phi: x + attn(ln1(x)) + mlp(ln2(x)), summed as the models sum, (attn + mlp) + x (Cohere:
        (x + attn) + mlp, `Family.residual_first`). As
        TransformerLens's parallel_attn_mlp: no hook_resid_mid; hook_mlp_in is a copy of resid_pre that only the MLP
        reads. Where one norm feeds both sublayers (GPT-J, Phi) ln2's points are that norm run again on the MLP's input
        (TransformerLens's ln2 is a copy of ln1), so a write at ln1 reaches attention only; unhooked, its one output
        feeds both, as in the model."""
        fam, pts = self.family, self._run.per_layer.get(l, {})

        def fire(point: str, x):
            return self._fire_at(l, point, x)

        x = fire("hook_resid_pre", hidden_states)  # [B, T, d]
        ln1 = getattr(layer_mod, fam.ln1)
        if self._inputs:  # TransformerLens's per-head inputs (GPT-J, Phi): the written ones, normed by ln1
            self._run.inputs[l] = fire_inputs(fire, pts, x, ln1, *self._heads)
        h = ln1(x)  # ln1.*
        a = self._attention_of(layer_mod, h, attn_kwargs)  # attn.*
        a = fire("hook_attn_out", fire("attn.hook_out", a))  # [B, T, d] after W_O: what is added
        mlp_in = _copy_point(fire, "hook_mlp_in", x) if "hook_mlp_in" in pts else x
        if fam.ln2 != fam.ln1:  # GPT-NeoX: a norm of its own
            h2 = getattr(layer_mod, fam.ln2)(mlp_in)  # ln2.*
        elif any(f"ln2.{p}" in pts for p in NORM_POINTS):
            given = self._run.shared_norm.pop(l, None) if mlp_in is x else None  # ln1's values on the same input
            h2 = self._norm(ln1, f"blocks.{l}.ln2", l, mlp_in, given)  # ln2.*: the shared norm's points again
        elif mlp_in is x and not any(f"ln1.{p}" in pts for p in NORM_POINTS):
            h2 = h  # nothing hooked: the model's one output
        else:
            h2 = type(ln1).forward(ln1, mlp_in)  # the norm itself, without ln1's hooks
        m = fire("hook_mlp_out", fire("mlp.hook_out", layer_mod.mlp(h2)))  # [B, T, d]
        drop = getattr(layer_mod, "post_attention_dropout", None) or getattr(layer_mod, "resid_dropout", None)
        if drop is not None:  # GPT-NeoX's and Phi's residual dropouts (identities in eval)
            a, m = drop(a), getattr(layer_mod, "post_mlp_dropout", drop)(m)
        return fire("hook_resid_post", (x + a) + m if fam.residual_first else (a + m) + x)  # [B, T, d]

    def _attention_of(self, layer_mod, x: torch.Tensor, attn_kwargs: dict) -> torch.Tensor:
        """A decoder layer's attention sublayer on x [B, T, d] (the normed stream), its attn.* points fired: the
        model's module (the attention interface's families), or poslens's copy of the model's own code (Falcon,
        GPT-Neo: `Family.own_attention`; BLOOM, whose attention adds the residual itself: without it)."""
        fam = self.family
        attn = layer_attention(fam, layer_mod)
        if fam.own_attention:
            return getattr(self, f"_{fam.own_attention}_attention")(attn, x, attn_kwargs)
        if fam.alibi:
            return self._alibi_attention(attn, x, attn_kwargs)
        return attn(hidden_states=x, **attn_kwargs)[0]

    def _alibi_attention(self, attn, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """BLOOM's attention on x [B, T, d] without its residual: the model's own operations (fused per-head q, k, v;
        q.k * 1/sqrt(D) + its per-key ALiBi bias by one baddbmm, plus the additive mask; float32 softmax; the dense
        projection), with the kernel's points fired by `_attention` in between."""
        bsz, t, _ = x.shape
        h, d = attn.num_heads, attn.head_dim
        q, k, v = attn._reshape(attn.query_key_value(x))  # [B, H, T, D] views; attn.hook_q/k/v fire here
        k, v = _cached(kwargs.get("layer_past"), attn.layer_idx, k, v)  # [B, H, T', D]: the earlier keys too
        alibi = kwargs["alibi"]  # [B * H, 1, T]: slope * key position

        def scores(query, key):  # q.k / sqrt(D) + slope_h * j, one baddbmm: [B, H, T, T]
            return alibi.baddbmm(batch1=query.reshape(bsz * h, -1, d),
                                 batch2=key.reshape(bsz * h, -1, d).transpose(-1, -2),
                                 beta=attn.beta, alpha=attn.inv_norm_factor).view(bsz, h, t, -1)

        def weigh(probs, value):  # [B, T, H, D]
            return torch.bmm(probs.view(bsz * h, t, -1), value.reshape(bsz * h, -1, d)).view(bsz, h, t, d) \
                .transpose(1, 2)

        def inner(module, query, key, value, mask, dropout=0.0, scaling=None, **_):
            s = scores(query, key)
            if mask is not None:
                s = s + mask
            probs = torch.softmax(s, dim=-1, dtype=torch.float32).to(query.dtype)
            return weigh(probs, value), probs

        key_bias = alibi.view(bsz, h, -1)  # slope_h * key position; TransformerLens's scores: minus it at the query
        memo = self._run.hidden
        eager = EagerSteps(lambda query, key, mask: _hide(scores(query, key), mask, 0, memo), weigh,
                           key_bias[..., -t:, None])  # the bias at the queries' positions (the last t keys)
        z, _ = self._attention(attn, inner, q, k, v, kwargs.get("attention_mask"), 0.0, attn.inv_norm_factor,
                               {"poslens_key_bias": key_bias}, eager)
        return attn.dense(z.reshape(bsz, t, h * d))  # attn.hook_result fires on dense

    def _falcon_attention(self, attn, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """Falcon's attention on x [B, T, d]: the model's own operations (the fused query_key_value split as its
        `_split_heads` splits it, attn.hook_q/k/v [B, T, heads, D] firing on the split; rotary, or ALiBi's bias in the
        model's mask; then, as the model's implementation, SDPA or q.k / sqrt(D) + the additive mask and a softmax;
        the dense projection), with the kernel's points fired by `_attention` in between."""
        l, bsz, t = attn.layer_idx, x.shape[0], x.shape[1]
        h, d, kv = attn.num_heads, attn.head_dim, attn.num_kv_heads
        grouped = attn.new_decoder_architecture  # falcon-40b: K groups of (H/K query heads, one key, one value)
        if grouped:  # k and v kept at their K heads (the model broadcasts them to every query head: `full`)
            qkv = attn.query_key_value(x).view(bsz, t, kv, h // kv + 2, d)
            q, k, v = qkv[:, :, :, :-2].flatten(2, 3), qkv[:, :, :, -2], qkv[:, :, :, -1]
        else:
            q, k, v = attn._split_heads(attn.query_key_value(x))  # [B, T, heads, D]; multi_query: k, v one head
        q, k, v = (self._fire_at(l, f"attn.hook_{n}", y) for n, y in zip("qkv", (q, k, v)))
        q = q.transpose(1, 2).reshape(bsz, h, t, d)
        k = k.transpose(1, 2).reshape(bsz, kv, t, d)
        v = v.transpose(1, 2).reshape(bsz, kv, t, d)
        mask = model_mask = kwargs.get("attention_mask")
        alibi, extra, memo = kwargs.get("alibi"), {}, self._run.hidden
        if alibi is None:
            cos, sin = kwargs["position_embeddings"]
            q, k = importlib.import_module(type(attn).__module__).apply_rotary_pos_emb(q, k, cos, sin)
        else:  # ALiBi: the model's mask carries slope_h * j / sqrt(D) where a key is seen (SDPA adds it to the scores)
            extra["poslens_key_bias"] = _memo(memo, ("key bias", id(alibi)),
                                              lambda: (alibi / math.sqrt(d)).view(bsz, h, -1))
            if mask is not None:  # the scores' points see the mask alone (0 where seen) and the bias as ctx.score_bias
                mask = _memo(memo, ("mask alone", id(mask)), lambda: torch.where(
                    model_mask < -1, model_mask, torch.zeros((), dtype=model_mask.dtype, device=model_mask.device)))
        k, v = _cached(kwargs.get("layer_past"), l, k, v)  # [B, K, T', D]: the earlier (rotated) keys too
        sdpa = attn.config._attn_implementation == "sdpa" or alibi is not None  # (ALiBi: refused under eager)

        def full(y):  # the new architecture's key or value heads [B, K, T', D] broadcast to every query head, as the
            # model's `_split_heads` materialises them (query head h reads group h // (H/K)); else as they are. The
            # model's copy lies as [B, T', H, D] (a cache's concatenation: as [B, H, T', D]); the same layout here, so
            # that its matmuls pick the same kernels (on AVX-512 another layout rounds otherwise)
            if not grouped:
                return y
            if y.is_contiguous():
                return y[:, :, None].expand(bsz, kv, h // kv, *y.shape[2:]).reshape(bsz, h, *y.shape[2:])
            y = y.transpose(1, 2)  # [B, T', K, D]
            return y[:, :, :, None].expand(*y.shape[:3], h // kv, d).reshape(bsz, -1, h, d).transpose(1, 2)

        def scores(query, key):  # the model's eager scores (rotary form): q.k divided by sqrt(D)
            s = query @ full(key).transpose(-1, -2)
            s /= math.sqrt(d)
            return s

        def weigh(probs, value):  # [B, T, H, D]
            return (probs @ full(value)).transpose(1, 2)

        def inner(module, query, key, value, mask, dropout=0.0, scaling=None, **_):
            if sdpa:  # the model's SDPA call
                out = torch.nn.functional.scaled_dot_product_attention(
                    query, full(key), full(value), attn_mask=model_mask, dropout_p=0.0,
                    is_causal=model_mask is None and t > 1)
                return out.transpose(1, 2), None
            probs = torch.softmax(scores(query, key) + mask, dim=-1, dtype=x.dtype)
            return weigh(probs, value), probs

        # an output from the pattern: the model's eager steps; ALiBi (which transformers' eager Falcon adds twice):
        # the interface families' steps, with the bias as TransformerLens puts it
        eager = EagerSteps(lambda query, key, mask: _hide(scores(query, key), mask, 0, memo), weigh) \
            if alibi is None else None
        z, _ = self._attention(attn, inner, q, k, v, mask, 0.0, attn.inv_norm_factor, extra, eager)
        return attn.dense(z.reshape(bsz, t, h * d))  # attn.hook_result fires on dense

    def _gpt_neo_attention(self, attn, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """GPT-Neo's attention on x [B, T, d]: the model's own operations (q, k, v projections, attn.hook_q/k/v firing
        on them; scores q.k in float32 without a 1/sqrt(D) scaling, keys outside a local layer's window of
        window_size hidden, plus the model's additive mask; a float32 softmax; out_proj), with the kernel's points
        fired by `_attention` in between."""
        bsz, t = x.shape[:2]
        h, d = attn.num_heads, attn.head_dim
        q, k, v = (attn._split_heads(proj(x), h, d) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))  # [B, H, T, D]
        k, v = _cached(kwargs.get("layer_past"), attn.layer_id, k, v)  # [B, H, T', D]: the earlier keys too
        window = int(attn.config.window_size) if attn.attention_type == "local" else 0
        memo = self._run.hidden

        def inner(module, query, key, value, mask, dropout=0.0, scaling=None, **_):  # the model's own steps
            out, probs = attn._attn(query, key, value, mask)
            return out.transpose(1, 2), probs

        def scores(query, key, mask):  # as `_attn`: q.k in float32, -inf (the model: float32's minimum) where hidden
            s = query.to(torch.float32) @ key.to(torch.float32).transpose(-1, -2)
            s = _hide(s, None, window, memo, replace=True)  # the causal mask and the window (the model's `bias`)
            return s if mask is None else _hide(s, mask, 0, memo)  # then the model's own mask (padding)

        def weigh(probs, value):  # [B, T, H, D]
            return (probs.to(value.dtype) @ value).transpose(1, 2)

        z, _ = self._attention(attn, inner, q, k, v, kwargs.get("attention_mask"), 0.0, 1.0,
                               {"sliding_window": window}, EagerSteps(scores, weigh))
        return attn.resid_dropout(attn.out_proj(z.reshape(bsz, t, h * d)))  # attn.hook_result fires on out_proj

    def _mpt_attention(self, attn, x: torch.Tensor, kwargs: dict) -> torch.Tensor:
        """MPT's attention on x [B, T, d]: the model's own operations (the fused Wqkv, clamped to clip_qkv if set,
        split into [q | k | v], attn.hook_q/k/v [B, T, H, D] firing on the split; q.k times softmax_scale plus ALiBi's
        bias slope_h * (j - (T' - 1)), the model's boolean mask (True = hidden) filled with the dtype's minimum; a
        float32 softmax; out_proj), with the kernel's points fired by `_attention` in between."""
        l, (bsz, t) = attn.layer_idx, x.shape[:2]
        h, d = attn.n_heads, attn.head_dim
        mixed = attn.Wqkv(x)
        if attn.clip_qkv:
            mixed = mixed.clamp(min=-attn.clip_qkv, max=attn.clip_qkv)
        q, k, v = (y.view(bsz, t, h, d) for y in _side_by_side(mixed, [h * d] * 3))  # [B, T, H, D] views
        q, k, v = (self._fire_at(l, f"attn.hook_{n}", y).transpose(1, 2) for n, y in zip("qkv", (q, k, v)))
        k, v = _cached(kwargs.get("layer_past"), l, k, v)  # [B, H, T', D]: the earlier keys too
        keys, model_mask, memo = k.shape[-2], kwargs.get("attention_mask"), self._run.hidden
        bias = kwargs["position_bias"]  # [H, 1, max_seq_len]: slope_h * (j - (max_seq_len - 1)), sliced as the model
        if bias.size(2) < keys:  # past max_seq_len (where transformers' forward fails): the model's own function for
            # the keys, the values a config with a larger max_seq_len gives (MPT's way to run ALiBi past training)
            bias = _memo(memo, ("mpt alibi", keys), lambda: self.model.base_model.build_mpt_alibi_tensor(
                h, keys, device=x.device))
        bias = bias[:, max(0, bias.size(1) - keys):, max(0, bias.size(2) - keys):]  # [H, 1, T']
        seen = None if model_mask is None else _memo(memo, ("seen", id(model_mask)), lambda: ~model_mask)

        def scores(query, key, mask):  # as the model: q.k * softmax_scale + the bias; -inf where hidden
            return _hide(torch.matmul(query, key.transpose(-1, -2)) * attn.softmax_scale + bias, mask, 0, memo,
                         replace=True)

        def weigh(probs, value):  # [B, T, H, D]
            return torch.matmul(probs, value).transpose(1, 2)

        def inner(module, query, key, value, mask, dropout=0.0, scaling=None, **_):  # the model's own steps
            s = torch.matmul(query, key.transpose(-1, -2)) * attn.softmax_scale + bias
            if model_mask is not None:
                s = s.masked_fill(model_mask, torch.finfo(query.dtype).min)
            probs = torch.softmax(s.float(), dim=-1).to(value.dtype)
            return weigh(probs, value), probs

        key_bias = _memo(memo, ("key bias", id(kwargs["position_bias"]), keys, bsz),
                         lambda: bias.transpose(0, 1).expand(bsz, h, keys))  # [B, H, T']
        eager = EagerSteps(scores, weigh, key_bias[..., -t:, None])  # the bias at the queries' positions
        z, _ = self._attention(attn, inner, q, k, v, seen, 0.0, attn.softmax_scale, {"poslens_key_bias": key_bias},
                               eager)
        return attn.out_proj(z.reshape(bsz, t, h * d))  # attn.hook_result fires on out_proj

    def _attention(self, module, inner, query, key, value, attention_mask, dropout, scaling, kwargs,
                   eager: EagerSteps | None = None):
        """Fire the attention kernel's points of one layer, then compute its output: the model's own function unless
        the scores or the pattern are formed (a hook at attn.hook_attn_scores or attn.hook_pattern reads them as a
        tensor); then the output is the pattern times the values, as the model's eager attention computes it, op for
        op (`eager`: its two steps, by default transformers' `eager_attention_forward`)."""
        l = layer_index(module)
        pts = self._run.per_layer.get(l, {})
        if not any(p in pts for p in KERNEL_POINTS):
            return inner(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        if scaling is None:
            scaling = module.head_dim**-0.5
        ctx = self._ctx("", l, rot_q=query, rot_k=key, v=value, scaling=scaling,
                        window=int(kwargs.get("sliding_window") or 0), softcap=kwargs.get("softcap"), module=module,
                        key_bias=kwargs.get("poslens_key_bias"))

        def fire(point: str, x, fns=None):
            fns = pts.get(point) if fns is None else fns
            if not fns:
                return x
            ctx.name = f"blocks.{l}.{point}"
            return self._fire(ctx.name, l, x, fns, ctx)

        def fire_heads(point: str, t):  # the hook sees TransformerLens's [B, T, heads, D]; the kernel [B, heads, T, D]
            if point not in pts:
                return t
            view = t.transpose(1, 2)
            new = fire(point, view)
            return t if new is view else new.transpose(1, 2)

        query = ctx.rot_q = fire_heads("attn.hook_rot_q", query)  # hook [B, T, H, D]; kernel [B, H, T, D]
        key = ctx.rot_k = fire_heads("attn.hook_rot_k", key)  # hook [B, T, K, D]; kernel [B, K, T, D]
        score_fns = pts.get("attn.hook_attn_scores", [])
        factored = [f for f in score_fns if getattr(f, "poslens_from_factors", False)]
        dense = [f for f in score_fns if not getattr(f, "poslens_from_factors", False)]
        pattern_fns = pts.get("attn.hook_pattern", [])
        if factored:
            ctx.name = f"blocks.{l}.attn.hook_attn_scores"
            if ctx.key_bias is not None:  # ALiBi: the factors carry the bias (HookContext.rot_q), for these readers
                ctx.rot_q, ctx.rot_k = _biased_factors(query, key, ctx.key_bias, scaling)
            for fn in factored:
                fn(None, ctx)
            ctx.rot_q, ctx.rot_k = query, key
            if not dense:
                self._fired(ctx.name)
        if not (dense or pattern_fns):  # no pattern formed: the model's own kernel (SDPA), bit-identical outputs
            out, _ = inner(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
            return fire("attn.hook_z", _editable(out, pts.get("attn.hook_z"))), None  # [B, T, H, D]
        memo = self._run.hidden
        if eager is None:  # transformers' eager_attention_forward (softcap: Gemma-2); ALiBi (Falcon's): TL's bias
            bias = None if ctx.key_bias is None else _memo(memo, ("score bias", id(ctx.key_bias)),
                                                           lambda: ctx.score_bias)
            eager = EagerSteps(lambda q, k, mask: _dense_scores(q, k, scaling, ctx.softcap, mask, ctx.window, memo,
                                                                 bias), _weigh)
        scores = eager.scores(query, key, attention_mask)  # [B, H, T, T] what the model's softmax reads
        evicted = (self._run.keys or 0) - key.shape[-2]  # a cached step of a sliding-window layer: the keys before
        if evicted > 0:  # its window are not in the cache; the points show every key, those hidden (as the mask does)
            scores = torch.nn.functional.pad(scores, (evicted, 0), value=-math.inf)
        shown = scores  # the scores as TransformerLens has them (BLOOM: the model's minus slope_h * i)
        if dense and eager.shift is not None:
            shown = scores - eager.shift
        seen = _seen(shown)
        new = fire("attn.hook_attn_scores", shown, dense)
        written = not _unchanged(new, shown, seen)  # replaced, or edited in place
        # NaN (a padded query that sees no key, or -inf * 0 written on a masked entry) becomes 0, as in
        # TransformerLens; out of place where autograd keeps the softmax's output
        pattern = torch.softmax(new if written else scores, dim=-1, dtype=torch.float32)
        if written or (attention_mask is not None and _memo(memo, ("padded",), lambda: _padded(
                self._run.attention_mask))):
            pattern = pattern.nan_to_num(0.0) if torch.is_grad_enabled() else pattern.nan_to_num_(0.0)
        pattern = fire("attn.hook_pattern", _editable(pattern.to(query.dtype), pattern_fns), pattern_fns)
        if evicted > 0:
            pattern = pattern[..., evicted:]  # the cached keys' weights (a write to the others has no key to weigh)
        return fire("attn.hook_z", eager.weigh(pattern, value)), None  # [B, T, H, D]


@dataclass
class EagerSteps:
    """A model's eager attention in the two steps around its softmax, op for op, so that an output computed from the
    pattern a hook reads is the model's eager output: `scores(query [B, H, T, D], key [B, K, T', D], mask)` -> the
    [B, H, T, T'] scores its softmax reads, -inf where the mask hides a key (the eager forms add the dtype's minimum
    there: the same softmax); `weigh(pattern, value [B, K, T', D])` -> z [B, T, H, D]; `shift` [B, H, T, 1], the
    model's scores minus TransformerLens's (BLOOM: its ALiBi bias slope_h * j differs from TL's slope_h * (j - i) by
    slope_h * i), or None."""

    scores: Callable[..., torch.Tensor]
    weigh: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    shift: torch.Tensor | None = None


def _weigh(pattern: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """z [B, T, H, D] = pattern @ value with value's heads shared by their query heads, as transformers' eager
    attention (repeat_kv, matmul, transpose, contiguous): the same operations (`_kv_matmul`)."""
    return _kv_matmul(pattern, value).transpose(1, 2).contiguous()


def _dense_scores(q, k, scaling, softcap, attention_mask, window: int, hidden: dict | None = None,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """[B, H, Tq, Tk] scores as transformers' eager attention computes them, op for op: q.k (the key heads repeated
    for their query heads, as repeat_kv: `_kv_matmul`), times scaling, softcapped (Gemma-2); then -inf where the
    model's mask hides a key (eager adds the dtype's minimum there: the same softmax), and `bias` (ALiBi) added.

    Without a softcap the scaling and the mask are one pass after the GEMM, mask + scaling * s with a 0 / -inf mask
    (the same rounding as s * scaling: one product rounded once, plus 0); `hidden` keeps that mask for all the layers
    of one forward. (The mask is not added in the GEMM's own pass: a baddbmm picks other kernels than the model's
    matmul on some CPUs, e.g. AVX-512, and rounds otherwise.)"""
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)  # out= and in place: not differentiable
    s = _kv_matmul(q, k, transpose=True)
    if bias is not None and softcap is None and not grad:  # ALiBi: scaling * s + (the bias, -inf where hidden), one
        # pass; the addend is made once per forward (one rounding where the steps below round twice: the softmax's
        # inputs move by an ulp, TransformerLens's own order has no reference in the model)
        addend = _memo(hidden, ("biased mask", id(attention_mask), id(bias), *s.shape[-2:], window),
                       lambda: bias + _hiding_mask(s, attention_mask, window, hidden))
        return torch.add(addend, s, alpha=scaling, out=s)
    if softcap is None:  # the model's scaling, then its mask: one pass
        mask = _hiding_mask(s, attention_mask, window, hidden)
        s = s * scaling + mask if grad else torch.add(mask, s, alpha=scaling, out=s)
    else:
        s = s * scaling if grad else s.mul_(scaling)
        s = (s / softcap).tanh() * softcap if grad else s.div_(softcap).tanh_().mul_(softcap)
        s = _hide(s, attention_mask, window, hidden)
    if bias is not None:
        s = s + bias if grad else s.add_(bias)
    return s


def _hidden(s: torch.Tensor, attention_mask, window: int, memo: dict | None = None) -> torch.Tensor:
    """Where the model's mask hides a key of the scores s [B, H, Tq, Tk] (True = hidden; broadcasts with s): the
    implicit causal (and sliding window) mask when `attention_mask` is None, a boolean one (True = seen), or an
    additive one (0 = seen); found once per mask, shape and forward in `memo`."""
    n, m = s.shape[-2:]

    def hides():
        if attention_mask is None:
            return hidden_keys(n, window, keys=m, device=s.device)
        if attention_mask.dtype == torch.bool:
            return ~attention_mask[..., :m]
        return attention_mask[..., :m] != 0  # eager masks are additive: 0 where attended, the dtype's minimum elsewhere

    return _memo(memo, ("hides", id(attention_mask), n, m, window, s.device), hides)


def _hiding_mask(s: torch.Tensor, attention_mask, window: int, memo: dict | None = None) -> torch.Tensor:
    """The additive form of `_hidden`: 0 where a key is seen, -inf where hidden, in s's dtype; made once per mask,
    shape, dtype and forward in `memo`."""
    def mask():
        hides = _hidden(s, attention_mask, window, memo)
        return torch.zeros(hides.shape, dtype=s.dtype, device=s.device).masked_fill_(hides, -math.inf)

    return _memo(memo, ("hiding mask", id(attention_mask), *s.shape[-2:], window, s.device, s.dtype), mask)


def _hide(s: torch.Tensor, attention_mask, window: int, memo: dict | None = None,
          replace: bool = False) -> torch.Tensor:
    """The scores s [B, H, Tq, Tk] with -inf where the model's mask hides a key, hidden as the model's eager attention
    hides them: by adding the 0 / -inf mask (`_hiding_mask`; the additive masks: a hidden score's NaN or +inf stays
    in the sum, as in the model's), or, `replace`, by writing -inf over them (GPT-Neo's torch.where, MPT's
    masked_fill). (One add is a tenth of a masked_fill_ of a broadcast boolean mask on the CPU.)"""
    grad = torch.is_grad_enabled() and s.requires_grad
    if replace:
        hides = _hidden(s, attention_mask, window, memo)
        return s.masked_fill(hides, -math.inf) if grad else s.masked_fill_(hides, -math.inf)
    mask = _hiding_mask(s, attention_mask, window, memo)
    return s + mask if grad else s.add_(mask)


def _biased_factors(q: torch.Tensor, k: torch.Tensor, key_bias: torch.Tensor, scaling: float):
    """[q, 1, -b_i / scaling] and [k, b_j / scaling, 1] ([B, H, T, D + 2]): scaling * their product is
    scaling * q.k + b_j - b_i, the score with ALiBi's bias in TransformerLens's form (per-key bias b [B, H, T])."""
    b = (key_bias / scaling).to(q.dtype)[..., None]
    bq = b[..., -q.shape[-2]:, :]  # the queries: the last keys (with a key/value cache, fewer than the keys)
    return torch.cat([q, torch.ones_like(bq), -bq], -1), torch.cat([k, b, torch.ones_like(b)], -1)


def _kv_matmul(a: torch.Tensor, b: torch.Tensor, transpose: bool = False) -> torch.Tensor:
    """[B, H, T, N] = a [B, H, T, M] @ b [B, K, ., .] with b's K key/value heads repeated for their H / K query heads
    (query head h reads key/value head h // (H / K)), transposed after the repeat when `transpose` (keys: b [B, K, T',
    D] gives a @ b^T), as transformers' eager attention computes it: repeat_kv, then one matmul of the same shapes and
    layouts, so the same floats on any CPU. (A GEMM that stacks a key head's query heads picks other kernels on some
    CPUs, e.g. AVX2 at odd lengths; one bmm per sequence on the head-strided q, k, v, which saves matmul's copies,
    rounds otherwise on AVX-512.)"""
    groups = a.shape[1] // b.shape[1]
    if groups > 1:
        bsz, kh = b.shape[:2]
        b = b[:, :, None].expand(bsz, kh, groups, *b.shape[2:]).reshape(bsz, kh * groups, *b.shape[2:])
    return torch.matmul(a, b.transpose(-1, -2) if transpose else b)


def _cached(cache, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values [B, K, T', D] attention reads: with a key/value cache (generation), the cache's earlier ones
    followed by these (the cache updated, as the model's own attention does); without, these."""
    return (k, v) if cache is None else cache.update(k, v, layer)


def _side_by_side(out: torch.Tensor, widths: list[int]) -> list[torch.Tensor]:
    """The parts of `out`'s last dimension of these widths, each a view of its own (`narrow`): a hook may edit one in
    place with autograd on (the views of one `split` refuse in-place edits under autograd)."""
    starts = [sum(widths[:i]) for i in range(len(widths))]
    return [out.narrow(-1, a, w) for a, w in zip(starts, widths)]


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are views of the same storage (an in-place edit of one is seen by the other)."""
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


def _block_forward(self, hidden_states, *args, **kwargs):
    """Replaces a decoder layer's forward while a HookedModel runs (bound to the layer)."""
    hm: HookedModel = getattr(self, _OWNER)
    bound = _signature(type(self)).bind(self, hidden_states, *args, **kwargs)
    attn_kwargs = {k: v for k, v in bound.arguments.items() if k not in ("self", "hidden_states")}
    attn_kwargs.update(attn_kwargs.pop("kwargs", {}))
    out = hm._block(self, layer_index(layer_attention(hm.family, self)), hidden_states, attn_kwargs)
    return (out, None) if hm.family.block_tuple else out


def _attention_fn(eager: bool):
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if eager:
            inner = importlib.import_module(type(module).__module__).eager_attention_forward
        else:
            inner = sdpa_attention_forward
        hm = getattr(module, _OWNER, None)
        if hm is None or hm._run is None:
            return inner(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
        return hm._attention(module, inner, query, key, value, attention_mask, dropout, scaling, kwargs)

    return attention


def _register() -> None:
    # Both registries: without a mask function transformers builds no mask at all (no padding, no window).
    AttentionInterface.register(ATTN_SDPA, _attention_fn(eager=False))
    AttentionMaskInterface.register(ATTN_SDPA, sdpa_mask)
    AttentionInterface.register(ATTN_EAGER, _attention_fn(eager=True))
    AttentionMaskInterface.register(ATTN_EAGER, eager_mask)
