"""A model's configuration and weights in TransformerLens 3.9's names and layouts (`HookedModel.cfg`, `W_Q`, ...).

    hm.cfg.n_layers, hm.cfg.d_head, hm.cfg.positional_embedding_type     # "rotary" (or "none": NoPE)
    hm.W_Q[l, h]      # [d_model, d_head]: q of head h = ln1 output @ W_Q[l, h] + b_Q[l, h] (OLMo-2: resid_pre)
    hm.W_O[l, h]      # [d_head, d_model]; hm.W_U [d_model, d_vocab]; hm.W_E [d_vocab, d_model]

The weights are the model's own, unprocessed (TransformerLens's `from_pretrained_no_processing`): the norms' gains stay
in the norms (`hm.ln_final` applies the final one), not folded into W_Q, W_U, ... Grouped-query K and V are expanded to
the query heads as TransformerLens's `W_K`/`W_V` are (query head h reads key head h // (n_heads / n_key_value_heads));
absent biases are zeros of TransformerLens's shapes. Each stacked weight is a fresh tensor built from the model's
parameters (editing it does not edit the model, as in TransformerLens); W_E and W_U read the parameters themselves.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from poslens.engine.activation_cache import NoEquivalent
from poslens.engine.factored import FactoredMatrix
from poslens.engine.families import (
    attention_module,
    base_part,
    decoder_layers,
    family_of,
    head_dim,
    kv_heads,
    mlp_module,
    norm_affine,
    norm_eps,
    positional_encoding,
)
from poslens.engine.models import max_positions
from poslens.engine.pe import PositionalEncoding, rotary_fraction
from poslens.errors import UsageError

# the model types whose TransformerLens config sets default_prepend_bos=False (its loading_from_pretrained)
NO_DEFAULT_BOS = ("gpt_neox", "bloom", "qwen2", "qwen3", "phi")


@dataclass
class TLConfig:
    """TransformerLens's `HookedTransformerConfig` fields that describe a supported model (read-only facts)."""

    model_name: str
    original_architecture: str
    n_layers: int
    d_model: int
    n_heads: int
    n_key_value_heads: int
    d_head: int
    d_mlp: int
    d_vocab: int
    d_vocab_out: int
    n_ctx: int
    act_fn: str
    eps: float
    normalization_type: str  # "RMS" (RMSNorm) or "LN" (GPT-2's LayerNorm with bias); gains not folded
    positional_embedding_type: str  # "rotary" when any layer rotates q and k, "standard" for a learned table (GPT-2),
    # else "none" (a NoPE model)
    rotary_dim: int | None
    rotary_base: float | None
    gated_mlp: bool
    num_experts: int | None  # a mixture of experts: the experts per layer (d_mlp is each expert's width), else None
    experts_per_token: int | None  # the experts chosen per token
    norm_topk_prob: bool  # the chosen experts' weights renormalised to sum to 1 (Mixtral's always)
    parallel_attn_mlp: bool  # attention and MLP both read the stream entering the block (GPT-NeoX, GPT-J, Phi)
    rotary_adjacent_pairs: bool  # RoPE turns adjacent dimension pairs (GPT-J), not the two halves
    final_rms: bool
    window_size: int | None  # the sliding window of the layers that have one
    use_local_attn: bool  # some layers attend a window of keys only
    attn_types: list[str] | None  # per layer "global" or "local" (a window) where some layer is local
    use_attn_scale: bool  # the scores are q.k divided by sqrt(d_head) (False: GPT-Neo's q.k as is)
    attn_scores_soft_cap: float
    output_logits_soft_cap: float
    default_prepend_bos: bool
    tokenizer_prepends_bos: bool | None
    device: str
    dtype: torch.dtype

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def tl_config(model, tokenizer=None) -> TLConfig:
    """The TransformerLens configuration of a loaded supported model (and its tokenizer, for the BOS facts)."""
    cfg, family = model.config, family_of(model.config)
    attn = attention_module(model, 0)
    pe = PositionalEncoding.of(model)
    rotates = any(p in ("rope", "partial-rope") for p in pe.rope)
    learned = "learned" in pe.rope
    heads = int(cfg.num_attention_heads)
    factor = rotary_fraction(cfg)
    windows = [w for w in pe.windows if w]
    prepends = None if tokenizer is None else len(tokenizer.encode("")) > 0
    return TLConfig(
        model_name=str(getattr(cfg, "_name_or_path", "") or type(model).__name__),
        original_architecture=type(model).__name__,
        n_layers=int(cfg.num_hidden_layers), d_model=int(cfg.hidden_size), n_heads=heads,
        n_key_value_heads=kv_heads(cfg), d_head=head_dim(attn),
        d_mlp=int(getattr(cfg, "moe_intermediate_size", None) or getattr(cfg, "intermediate_size", None)
                  or getattr(cfg, "n_inner", None)
                  or getattr(cfg, "ffn_dim", None) or getattr(cfg, "ffn_hidden_size", None)
                  or 4 * cfg.hidden_size),  # GPT-2: n_inner; OPT: ffn_dim; Falcon: ffn_hidden_size; MPT: 4 d
        d_vocab=int(cfg.vocab_size),
        d_vocab_out=int(model.get_output_embeddings().weight.shape[0]), n_ctx=max_positions(model),
        act_fn="gelu_fast" if cfg.model_type == "bloom" else  # BLOOM's config names none: its tanh GELU, as TL's
        "gelu" if cfg.model_type == "mpt" else  # MPT's names none either: the exact GELU (nn.GELU())
        str(getattr(cfg, "hidden_act", None) or getattr(cfg, "hidden_activation", None)
                   or getattr(cfg, "activation_function", None) or getattr(cfg, "activation", "")),  # Falcon
        eps=float(getattr(cfg, "rms_norm_eps", None) or getattr(cfg, "layer_norm_eps", None)
                  or getattr(cfg, "layer_norm_epsilon", None)
                  or norm_eps(base_part(model, family.final_norm_attr))),  # OPT: its LayerNorms' default
        normalization_type="LN" if family.norm_kind == "layer" else "RMS",
        positional_embedding_type="rotary" if rotates else "standard" if learned else
        "alibi" if "alibi" in pe.rope else "none",
        rotary_dim=round(head_dim(attn) * factor) if rotates else None,
        rotary_base=pe.rope_theta if rotates else None,
        gated_mlp=family.gated_mlp, parallel_attn_mlp=family.layout == "parallel",
        num_experts=int(getattr(cfg, "num_local_experts", None) or cfg.num_experts) if family.moe else None,
        experts_per_token=int(cfg.num_experts_per_tok) if family.moe else None,
        norm_topk_prob=family.moe and bool(getattr(cfg, "norm_topk_prob", True)),  # (Mixtral's config has none)
        rotary_adjacent_pairs=family.rotary_adjacent_pairs, final_rms=family.norm_kind == "rms",
        window_size=windows[0] if windows else None, use_local_attn=bool(windows),
        attn_types=["local" if w else "global" for w in pe.windows] if windows else None,
        use_attn_scale=cfg.model_type != "gpt_neo",
        attn_scores_soft_cap=float(getattr(cfg, "attn_logit_softcapping", None) or -1.0),
        output_logits_soft_cap=float(getattr(cfg, "final_logit_softcapping", None) or -1.0),
        default_prepend_bos=cfg.model_type not in NO_DEFAULT_BOS, tokenizer_prepends_bos=prepends,
        device=str(model.device), dtype=model.dtype)


def _heads_in(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A projection's weight [heads * D, d_model] as TransformerLens's [heads, d_model, D]."""
    return weight.unflatten(0, (heads, -1)).transpose(1, 2)


def _linear_weight(module) -> torch.Tensor:
    """A projection's weight as nn.Linear keeps it, [out, in] (GPT-2's Conv1D keeps [in, out])."""
    return module.weight.T if type(module).__name__ == "Conv1D" else module.weight


def _per_head_fused(attn, cfg):
    """The fused projection of GPT-NeoX, BLOOM and Falcon-RW (rows [q | k | v] within each head), or None."""
    per_head = family_of(cfg).qkv_per_head
    if per_head:
        return getattr(attn, per_head)
    if getattr(attn, "new_decoder_architecture", False):  # Falcon's grouped layout: `_grouped_falcon`
        return None
    if getattr(attn, "multi_query", None) is False:  # Falcon without multi-query
        return attn.query_key_value
    return None


def _qkv(attn, cfg) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple]:
    """(W_q, W_k, W_v) as nn.Linear weights [out, d_model] and their biases (None where absent); not for a per-head
    fused projection (`_per_head_fused`)."""
    fused = getattr(attn, "qkv_proj", None) or getattr(attn, "c_attn", None) or getattr(attn, "Wqkv", None)  # MPT's
    if getattr(attn, "multi_query", None):  # Falcon multi-query: [q heads | k | v] (GPT-BigCode's: c_attn, above)
        fused = getattr(attn, "query_key_value", fused)
    if fused is not None:  # Phi-3's qkv_proj, GPT-2's c_attn, MPT's Wqkv, Falcon's multi-query query_key_value:
        # rows [q | k | v]
        d, heads = head_dim(attn), cfg.num_attention_heads
        kv = kv_heads(cfg)
        sizes = [heads * d, kv * d, kv * d]
        ws = _linear_weight(fused).split(sizes, 0)
        bs = fused.bias.split(sizes, 0) if fused.bias is not None else (None,) * 3
        return (*ws, bs)
    ps = (attn.q_proj, attn.k_proj, attn.v_proj)
    return (*(p.weight for p in ps), tuple(p.bias for p in ps))


def _o_proj(attn):
    """An attention module's output projection W_O."""
    for name in ("o_proj", "dense", "out_proj"):  # GPT-NeoX, Phi, BLOOM: dense; GPT-J, OPT: out_proj
        if hasattr(attn, name):
            return getattr(attn, name)
    return attn.c_proj


# no gate: GPT-NeoX and BLOOM, GPT-J, Phi and OPT (OPT's fc1 and fc2 are on the layer itself)
_UP, _DOWN = ("dense_h_to_4h", "fc_in", "fc1"), ("dense_4h_to_h", "fc_out", "fc2")  # (MPT's ffn: up_proj, down_proj)


def _down(mlp):
    for name in ("down_proj", *_DOWN):
        if hasattr(mlp, name):
            return getattr(mlp, name)
    return mlp.c_proj


def _gate_up(mlp) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(gate, up) weights [d_mlp, d_model] (GPT-2: no gate, None; up = c_fc; OPT: fc1)."""
    if hasattr(mlp, "c_fc"):
        return None, _linear_weight(mlp.c_fc)
    for name in _UP:
        if hasattr(mlp, name):
            return None, getattr(mlp, name).weight
    if hasattr(mlp, "gate_up_proj"):  # Phi-3: rows [gate | up]
        return mlp.gate_up_proj.weight.chunk(2, 0)
    if not hasattr(mlp, "gate_proj"):  # MPT: up_proj alone
        return None, mlp.up_proj.weight
    return mlp.gate_proj.weight, mlp.up_proj.weight


def layer_attn_weight(model, l: int, which: int, bias: bool = False, expand: bool = True) -> torch.Tensor:
    """Layer l's W_Q, W_K or W_V (`which` 0, 1, 2) in TransformerLens's [heads, d_model, d_head] (a view of the
    parameter where no expansion is needed), or its bias [heads, d_head] (zeros where absent). With `expand`, K and V
    are repeated to the query heads as TransformerLens's `W_K`/`W_V` (a fresh tensor); without, [K, ...] as its
    `_W_K`/`_W_V`."""
    cfg = model.config
    h = cfg.num_attention_heads
    kv = kv_heads(cfg)
    attn = attention_module(model, l)
    heads = h if which == 0 else kv
    if getattr(attn, "new_decoder_architecture", False):  # Falcon-40b's [K groups x (H/K q heads, k, v)] x D rows
        t = _grouped_falcon(attn.query_key_value, h, kv, which, bias)
        return t.repeat_interleave(h // kv, 0) if which and expand and h != kv else t
    fused = _per_head_fused(attn, cfg)
    if fused is not None:  # [heads, 3, D, d_model] and select: a strided view of the fused parameter
        if bias:
            b = fused.bias
            return b.unflatten(0, (h, 3, -1))[:, which] if b is not None else fused.weight.new_zeros(h, head_dim(attn))
        return fused.weight.unflatten(0, (h, 3, -1))[:, which].transpose(1, 2)
    *ws, bs = _qkv(attn, cfg)
    if bias:
        b = bs[which]
        t = b.unflatten(0, (heads, -1)) if b is not None else ws[which].new_zeros(heads, head_dim(attn))
    else:
        t = _heads_in(ws[which], heads)
    return t.repeat_interleave(h // kv, 0) if which and expand and h != kv else t  # GQA: query head h reads h // (h/K)


def _grouped_falcon(fused, h: int, kv: int, which: int, bias: bool) -> torch.Tensor:
    """W_Q [H, d_model, D], W_K or W_V [K, d_model, D] (or their biases [., D]) from Falcon's new-architecture fused
    projection, whose rows are K groups of (H/K query heads, one key head, one value head), D rows each: views of the
    parameter (the query heads' through a reshape of a strided view: a copy)."""
    g = h // kv
    p = fused.bias if bias else fused.weight
    if p is None:
        return fused.weight.new_zeros(h if which == 0 else kv, fused.weight.shape[0] // (kv * (g + 2)))
    grouped = p.unflatten(0, (kv, g + 2, -1))  # [K, H/K + 2, D, (d_model)]
    part = grouped[:, :g].flatten(0, 1) if which == 0 else grouped[:, g + which - 1]
    return part if bias else part.transpose(1, 2)


def layer_w_o(attn, heads: int) -> torch.Tensor:
    """An attention module's W_O [heads, d_head, d_model] (a view of the parameter)."""
    return _linear_weight(_o_proj(attn)).T.unflatten(0, (heads, -1))


class TLWeights:
    """TransformerLens's weight views of `self.model` (mixed into HookedModel)."""

    model: Any
    attns: list  # each layer's attention module (HookedModel's)

    def _attn_weight(self, which: int, bias: bool = False) -> torch.Tensor:
        return torch.stack([layer_attn_weight(self.model, l, which, bias)
                            for l in range(len(decoder_layers(self.model)))])

    def _mlp_of(self, layer):
        return mlp_module(self.family, layer)

    def _dense_mlps(self, name: str) -> list:
        """Every layer's MLP module, or a one-line NoEquivalent for a mixture of experts (no one matrix per layer)."""
        if self.family.moe:
            raise NoEquivalent(f"{name}: a {self.family.name} layer has one {name} per expert, as in "
                               f"TransformerLens: hm.blocks[l].mlp.experts[e].{name}.weight (the router: "
                               "hm.blocks[l].mlp.W_gate.weight)")
        return [self._mlp_of(layer) for layer in decoder_layers(self.model)]

    @property
    def W_Q(self) -> torch.Tensor:
        """[n_layers, n_heads, d_model, d_head]"""
        return self._attn_weight(0)

    @property
    def W_K(self) -> torch.Tensor:
        """[n_layers, n_heads, d_model, d_head] (key/value heads repeated to the query heads, as TransformerLens)"""
        return self._attn_weight(1)

    @property
    def W_V(self) -> torch.Tensor:
        """[n_layers, n_heads, d_model, d_head]"""
        return self._attn_weight(2)

    @property
    def b_Q(self) -> torch.Tensor:
        """[n_layers, n_heads, d_head] (zeros where the model has no bias)"""
        return self._attn_weight(0, bias=True)

    @property
    def b_K(self) -> torch.Tensor:
        return self._attn_weight(1, bias=True)

    @property
    def b_V(self) -> torch.Tensor:
        return self._attn_weight(2, bias=True)

    @property
    def W_O(self) -> torch.Tensor:
        """[n_layers, n_heads, d_head, d_model]"""
        h = self.model.config.num_attention_heads
        return torch.stack([layer_w_o(attn, h) for attn in self.attns])

    @property
    def b_O(self) -> torch.Tensor:
        """[n_layers, d_model]"""
        return torch.stack([_bias(_o_proj(attn)) for attn in self.attns])

    @property
    def W_gate(self) -> torch.Tensor:
        """[n_layers, d_model, d_mlp]: the gate projection (hook_pre = x @ W_gate)"""
        if not self.family.gated_mlp:
            raise NoEquivalent(f"W_gate: the {self.family.name} MLP has no gate (one up projection: W_in)")
        return torch.stack([_gate_up(mlp)[0].T for mlp in self._dense_mlps("W_gate")])

    @property
    def W_in(self) -> torch.Tensor:
        """[n_layers, d_model, d_mlp]: the up projection (hook_pre_linear = x @ W_in), as TransformerLens's gated MLP"""
        return torch.stack([_gate_up(mlp)[1].T for mlp in self._dense_mlps("W_in")])

    @property
    def b_in(self) -> torch.Tensor:
        """[n_layers, d_mlp] (zeros where the MLP has no bias)"""
        return torch.stack([_up_bias(mlp) for mlp in self._dense_mlps("b_in")])

    @property
    def W_out(self) -> torch.Tensor:
        """[n_layers, d_mlp, d_model]"""
        return torch.stack([_linear_weight(_down(mlp)).T for mlp in self._dense_mlps("W_out")])

    @property
    def b_out(self) -> torch.Tensor:
        """[n_layers, d_model]"""
        return torch.stack([_bias(_down(mlp)) for mlp in self._dense_mlps("b_out")])

    @property
    def W_E(self) -> torch.Tensor:
        """[d_vocab, d_model]: the token embeddings as hook_embed sees them (Gemma: times its sqrt(d_model) scale, as
        TransformerLens folds it)"""
        embed = self.model.get_input_embeddings()
        scale = getattr(embed, "embed_scale", None)
        return embed.weight if scale is None else embed.weight * scale.to(embed.weight.dtype)

    @property
    def W_pos(self) -> torch.Tensor:
        """[n_ctx, d_model]: the learned position table (GPT-2's wpe; hook_pos_embed is its rows at the positions; OPT:
        its rows after the first two, which position 0 skips, as TransformerLens's W_pos)"""
        if self.family.pos_embed_attr:
            return base_part(self.model, self.family.pos_embed_attr).weight[self.family.pos_offset:]
        pe = positional_encoding(self.model)
        kind = "ALiBi (a per-head bias inside attn.hook_attn_scores; ctx.score_bias)" if "alibi" in pe else \
            "rotary (RoPE acts on q and k: attn.hook_rot_q, attn.hook_rot_k)" \
            if any(p != "none" for p in pe) else "none (a NoPE model)"
        raise NoEquivalent(f"W_pos: this model has no positional embedding matrix; its positional encoding is {kind}")

    @property
    def W_U(self) -> torch.Tensor:
        """[d_model, d_vocab_out]: the LM head (a view of its weight)"""
        return self.model.get_output_embeddings().weight.T

    @property
    def b_U(self) -> torch.Tensor:
        """[d_vocab_out]"""
        head = self.model.get_output_embeddings()
        return head.bias if head.bias is not None else head.weight.new_zeros(head.weight.shape[0])

    def norm_module(self, prefix: str):
        """The norm module of a point prefix: "ln_final", "blocks.{l}.ln1", "blocks.{l}.ln2", ..."""
        if prefix not in self._norms:
            raise UsageError(f"no norm {prefix!r} on this model (e.g. ln_final, blocks.0.ln1, blocks.0.ln2)")
        return self._norms[prefix][0]

    def norm_gain(self, prefix: str) -> torch.Tensor:
        """The gain a norm multiplies its normalized input by ([d]; Gemma's 1 + weight), as the forward does."""
        module = self.norm_module(prefix)
        weight, _ = norm_affine(module)
        if weight is None:  # OLMo's LayerNorm: no gain
            return torch.ones_like(self.model.get_input_embeddings().weight[0], dtype=torch.float32)
        w = weight.float()
        return 1.0 + w if self.family.norm_gain == "1+weight" else w  # (GPT-2's LayerNorm adds its bias after)

    @property
    def ln_final(self):
        """TransformerLens's `model.ln_final`: the final norm as blocks' ln1 (`w`, `b`, `hook_scale`,
        `hook_normalized`; called, the model's own norm, gain included, as the LM head reads it)."""
        from poslens.engine.tl_blocks import Norm

        return Norm(self, None, "ln_final.")

    def _hook_point(self, name: str):
        """TransformerLens's `model.hook_embed`, ...: the HookPoint of a point outside the blocks."""
        from poslens.engine.tl_blocks import HookPoint

        if name not in self._known:
            raise NoEquivalent(f"{name}: this {self.family.name} model has no such hook point (hm.points lists the "
                               "points; a model without a learned position table has no hook_pos_embed)")
        return HookPoint(self, name)

    hook_embed = property(lambda self: self._hook_point("hook_embed"), doc="the HookPoint of hook_embed")
    hook_pos_embed = property(lambda self: self._hook_point("hook_pos_embed"),
                              doc="the HookPoint of hook_pos_embed (GPT-2 and OPT: a learned position table)")

    @property
    def OV(self) -> FactoredMatrix:
        """[n_layers, n_heads] of d_model x d_model: each head's OV circuit W_V @ W_O, kept factored (GQA: W_V
        repeated to the query heads, as TransformerLens)."""
        return FactoredMatrix(self.W_V, self.W_O)

    @property
    def QK(self) -> FactoredMatrix:
        """[n_layers, n_heads] of d_model x d_model: each head's QK circuit W_Q @ W_K^T (before RoPE), kept
        factored."""
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def blocks(self):
        """TransformerLens's `model.blocks`: blocks[l].attn, .mlp, .ln1, ... with their weights and hook points
        (poslens.engine.tl_blocks)."""
        from poslens.engine.tl_blocks import Blocks

        return Blocks(self)

    @property
    def embed(self) -> Embed:
        """TransformerLens's `model.embed`: tokens -> embeddings as hook_embed sees them, with `W_E`."""
        return Embed(self)

    @property
    def unembed(self) -> Unembed:
        """TransformerLens's `model.unembed`: x -> x @ W_U + b_U with the model's LM head (Gemma-2's final logit
        softcap comes after it, as in TransformerLens), with `W_U` and `b_U`."""
        return Unembed(self)


class Embed:
    """TransformerLens's embedding component of a HookedModel: call it on token ids; `W_E`."""

    def __init__(self, owner: TLWeights) -> None:
        self._owner = owner

    @property
    def W_E(self) -> torch.Tensor:
        return self._owner.W_E

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embeddings of token ids, as hook_embed sees them (BLOOM: after its embedding LayerNorm, embed.ln,
        which TransformerLens's Embed applies)."""
        x = self._owner.W_E[tokens]
        return self._owner.norm_module("embed.ln")(x) if "embed.ln" in self._owner._norms else x


class Unembed:
    """TransformerLens's unembedding component of a HookedModel: call it on the final norm's output; `W_U`, `b_U`."""

    def __init__(self, owner: TLWeights) -> None:
        self._owner = owner

    @property
    def W_U(self) -> torch.Tensor:
        return self._owner.W_U

    @property
    def b_U(self) -> torch.Tensor:
        return self._owner.b_U

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._owner.model.get_output_embeddings()(x)


def _up_bias(mlp) -> torch.Tensor:
    """The up projection's bias [d_mlp] (GPT-2's c_fc has one; zeros where absent)."""
    up = next((getattr(mlp, n) for n in ("c_fc", "up_proj", *_UP) if hasattr(mlp, n)), None)
    if up is not None and up.bias is not None:
        return up.bias
    return _gate_up(mlp)[1].new_zeros(_gate_up(mlp)[1].shape[0])


def _bias(linear) -> torch.Tensor:
    return linear.bias if linear.bias is not None else linear.weight.new_zeros(linear.weight.shape[0])
