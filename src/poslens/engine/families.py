"""One registry of model families: where the parts of a decoder live and how its attention is set up.

A `Family` says, for the transformers classes of one architecture: the block layout (pre-norm, as Llama:
x + attn(norm(x)); Gemma's sandwich with a norm after each sublayer too; OLMo-2's post-norm, x + norm(attn(x));
GPT-NeoX's, GPT-J's, Phi's, Falcon's and Cohere's parallel residual, x + attn(norm(x)) + mlp(norm(x))), the
names of the norms, whether the
forward needs the model's eager attention (Gemma-2's logit softcap), and how to read, from a config, the sliding
window and the positional encoding of every layer. Nothing here imports the analysis engine; the loader
(`poslens.engine.models`) vets configs with `check_supported` before any weight is read.

Positional encoding is a property of a loaded model: `positional_encoding(model)` gives one entry per layer, "rope",
"partial-rope" (rotary on part of each head: Phi-3's and Phi's partial rotary factor, Pythia's rotary_pct, GPT-J's
rotary_dim), "learned" (GPT-2's, OPT's, GPT-Neo's and GPT-BigCode's position tables), "alibi" (BLOOM's, MPT's and
Falcon-RW's linear biases; `scale_alibi` scales them) or "none" (Cohere2's full-attention layers); the whole encoding
(RoPE base and scaling, sliding windows, label) is the one type `poslens.engine.pe.PositionalEncoding`. A model
loaded with `pe="none"` (a Llama-like checkpoint trained without positional encoding, such as the paper's released
NoPE model) has its rotary embedding replaced by the identity (ALiBi: every slope 0) for as long as it lives, and
says so here; SmolLM3's per-layer `no_rope_layers` is read from the config.
"""

from __future__ import annotations

import copy
import importlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from poslens.engine.pe import PE_ATTR, PositionalEncoding
from poslens.errors import UsageError

PE_CHOICES = ("auto", "none", "rope")


@dataclass(frozen=True)
class Family:
    """Facts about one architecture (see the module docstring)."""

    name: str
    layout: str = "pre-norm"  # or "sandwich": norm(sublayer(norm(x))) added to x (Gemma-2, Gemma-3), or
    # "post-norm": norm(sublayer(x)) added to x (OLMo-2; ln1 and ln2 are the norms after attention and after the MLP),
    # or "parallel": attn(ln1(x)) + mlp(ln2(x)) added to x (GPT-NeoX, GPT-J, Phi; see below)
    ln1: str = "input_layernorm"  # the norm before attention
    ln2: str = "post_attention_layernorm"  # the norm before the MLP (pre-norm layout)
    ln1_post: str | None = None  # sandwich: the norm after attention
    ln2_pre: str | None = None  # sandwich: the norm before the MLP
    ln2_post: str | None = None  # sandwich: the norm after the MLP
    eager_output: bool = False  # the model's output comes from its own eager attention (no SDPA path)
    softcap_attr: str | None = None  # config field of an attention logit softcap passed to the attention function
    norm_gain: str = "weight"  # RMSNorm gain: "weight" (Llama: w * normalized, cast to the model dtype first),
    # "1+weight" (Gemma: (1 + w) * normalized in float32, cast after) or "weight-float32" (OLMo-2: w * normalized in
    # float32, cast after); read by the hook engine's norm points
    qk_norm_heads_first: bool = False  # the q/k norm (if any) reads [B, heads, T, D] (Gemma-3), not [B, T, heads, D]
    qk_norm_whole: bool = False  # the q/k norm (if any) normalizes the whole projection [B, T, heads * D] (OLMo-2)
    qk_norm_attrs: tuple[str, str] = ("q_norm", "k_norm")  # the attention's q and k norm modules, where it has them
    # (StableLM's: q_layernorm, k_layernorm); a LayerNorm family's q/k norms are LayerNorms of each head's D entries
    # where the parts live (module attributes): the base model's layers, embeddings and final norm; a layer's
    # attention; a learned position table (GPT-2's wpe), the norm kind ("rms" or "layer": LayerNorm, with a bias, or
    # OLMo's without weight or bias: `norm_affine`)
    layers_attr: str = "layers"
    attn_attr: str = "self_attn"
    embed_attr: str = "embed_tokens"
    pos_embed_attr: str | None = None
    final_norm_attr: str = "norm"
    norm_kind: str = "rms"
    gated_mlp: bool = True  # gate and up projections (Llama); False: one up projection (GPT-2's c_fc), no
    # mlp.hook_pre_linear
    per_head_inputs: bool = True  # TransformerLens's hook_attn_in / hook_q_input ... (poslens.engine.tl_inputs) are
    # built for separate or fused Linear q, k, v after an input norm (GPT-J, Phi, OPT too) and for the per-head fused
    # query_key_value (GPT-NeoX, BLOOM, Falcon); not yet GPT-2's Conv1D or OLMo-2's post-norm
    # the "parallel" layout (GPT-NeoX, GPT-J, Phi): x + attn(ln1(x)) + mlp(ln2(x)), both sublayers read the stream
    # entering the block (no hook_resid_mid, as TransformerLens's parallel_attn_mlp); ln2 == ln1 where one norm
    # feeds both (GPT-J, Phi: TransformerLens fires ln2's points on a copy of ln1). Module names where they are not
    # Llama's: `proj` = (attention output, MLP up, MLP down) projections; `qkv_per_head`: one fused projection whose
    # output holds each head's [q | k | v] side by side (GPT-NeoX's and BLOOM's query_key_value)
    proj: tuple[str, str, str] | None = None
    qkv_per_head: str | None = None
    rotary_adjacent_pairs: bool = False  # the rotary turns pairs of adjacent dims (GPT-J's rotate_every_two,
    # Cohere's interleaved cos and sin); TransformerLens's rotary_adjacent_pairs
    rotary_sin_first: bool = False  # the rotary module returns (sin, cos) (GPT-J), not (cos, sin)
    residual_first: bool = False  # parallel layout: the block sums (x + attn) + mlp (Cohere), not (attn + mlp) + x
    # OPT: the parts above may be dotted paths under the base model (its decoder: "decoder.layers"); its position
    # table begins `pos_offset` rows in (OPT's embed_positions looks up position + 2; TransformerLens's W_pos drops
    # those rows); its MLP is the layer's own fc1 and fc2 (mlp_attr "": no MLP module)
    pos_offset: int = 0
    mlp_attr: str = "mlp"
    # the MLP's (up, activation, down) attributes where its module cannot be called alone (OPT: none; BLOOM's adds the
    # residual inside); None: the MLP module is called
    mlp_seq: tuple[str, str, str] | None = None
    # BLOOM: ALiBi, a per-head linear bias inside the scores (no rotation, no table); a LayerNorm after the token
    # embedding (TransformerLens's embed.ln; hook_embed is its output, as TransformerLens's)
    alibi: bool = False
    alibi_from_mask: bool = True  # the model builds its ALiBi tensor from the [B, T] mask (BLOOM, Falcon-RW), not from
    # the key count alone (MPT)
    embed_norm_attr: str | None = None
    block_tuple: bool = False  # the decoder layer returns (hidden states, attentions) (BLOOM), not a tensor
    eager_only: bool = False  # transformers has one attention implementation for it, "eager" (BLOOM): loaded with it
    # Falcon, GPT-Neo: the attention is the model's own code (not transformers' attention interface), run by the hook
    # engine's copy of it, `HookedModel._{own_attention}_attention` (Falcon's fires attn.hook_q, hook_k and hook_v on
    # its fused query_key_value's split); None: the attention interface's
    own_attention: str | None = None
    windows_in_module: bool = False  # the attention module hides the keys past its layer's window itself, on top of
    # any mask it is given (GPT-Neo's local layers: a buffer); elsewhere the window is in the mask transformers builds
    clip_qkv_in_place: bool = False  # the config's clip_qkv clamps q, k and v in place after their projections (OLMo)
    # a mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): a sparse layer's MLP is a router (`gate`, weight
    # [E, d]) and fused experts (transformers 5's `experts`: gate_up_proj [E, 2M, d] with rows [gate | up], down_proj
    # [E, d, M]), Qwen2-MoE's with a shared expert beside them; a dense layer (Qwen's mlp_only_layers) keeps Llama's
    # MLP (`sparse_mlp`)
    moe: bool = False

    @property
    def norm_points(self) -> dict[str, str]:
        """Hook point (under blocks.{l}.) -> module attribute of the decoder layer, in forward order."""
        if self.layout in ("pre-norm", "post-norm", "parallel"):
            return {"ln1": self.ln1, "ln2": self.ln2}
        return {"ln1": self.ln1, "ln1_post": self.ln1_post, "ln2": self.ln2_pre, "ln2_post": self.ln2_post}

    @property
    def attn_input(self) -> str:
        """The hook point (under blocks.{l}.) whose value the q, k and v projections read: the input norm's output, or
        the residual stream itself where no norm comes first (post-norm)."""
        return "hook_resid_pre" if self.layout == "post-norm" else "ln1.hook_out"

    @property
    def mlp_input(self) -> str:
        """The hook point (under blocks.{l}.) whose value the MLP reads (post-norm: the residual stream)."""
        return "hook_resid_mid" if self.layout == "post-norm" else "ln2.hook_out"


_SANDWICH = dict(layout="sandwich", norm_gain="1+weight", ln1="input_layernorm", ln1_post="post_attention_layernorm",
                 ln2_pre="pre_feedforward_layernorm", ln2_post="post_feedforward_layernorm",
                 ln2="pre_feedforward_layernorm")

FAMILIES: dict[str, Family] = {
    "llama": Family("Llama"),
    "qwen2": Family("Qwen2"),
    "qwen3": Family("Qwen3"),
    "mistral": Family("Mistral"),
    "phi3": Family("Phi-3"),
    "smollm3": Family("SmolLM3"),
    "gemma": Family("Gemma", norm_gain="1+weight"),  # Llama's block; Gemma's (1 + w) norms and sqrt(d) embedding
    "gemma3_text": Family("Gemma-3 (text)", qk_norm_heads_first=True, **_SANDWICH),
    "gemma2": Family("Gemma-2", eager_output=True, softcap_attr="attn_logit_softcapping", eager_only=True,
                     **_SANDWICH),  # transformers refuses SDPA for it (the attention softcap)
    # GPT-2: learned absolute positions (wpe), LayerNorm with bias, Conv1D projections (c_attn fused [q | k | v])
    "gpt2": Family("GPT-2", ln1="ln_1", ln2="ln_2", layers_attr="h", attn_attr="attn", embed_attr="wte",
                   pos_embed_attr="wpe", final_norm_attr="ln_f", norm_kind="layer", gated_mlp=False,
                   per_head_inputs=False),
    # GPT-BigCode (StarCoder, SantaCoder, starcoderbase): GPT-2's learned table and LayerNorms with Linear projections
    # and multi-query attention (multi_query: c_attn [q heads | k | v], one key/value head; without it each head's
    # [q | k | v] side by side: `family_of`), scores through transformers' attention interface
    "gpt_bigcode": Family("GPT-BigCode", ln1="ln_1", ln2="ln_2", layers_attr="h", attn_attr="attn", embed_attr="wte",
                          pos_embed_attr="wpe", final_norm_attr="ln_f", norm_kind="layer", gated_mlp=False),
    # OPT: learned absolute positions (decoder.embed_positions, offset 2), pre-norm LayerNorm with bias, q/k/v/out
    # Linear with biases, ReLU fc1/fc2 on the layer itself
    "opt": Family("OPT", ln1="self_attn_layer_norm", ln2="final_layer_norm", layers_attr="decoder.layers",
                  embed_attr="decoder.embed_tokens", pos_embed_attr="decoder.embed_positions", pos_offset=2,
                  final_norm_attr="decoder.final_layer_norm", norm_kind="layer", gated_mlp=False, mlp_attr="",
                  mlp_seq=("fc1", "activation_fn", "fc2")),
    # BLOOM: ALiBi, a LayerNorm after the token embedding, fused query_key_value ([q | k | v] within each head),
    # LayerNorm with bias, GELU MLP (dense_h_to_4h, dense_4h_to_h); attention and MLP add the residual themselves
    "bloom": Family("BLOOM", layers_attr="h", attn_attr="self_attention", embed_attr="word_embeddings",
                    embed_norm_attr="word_embeddings_layernorm", final_norm_attr="ln_f", norm_kind="layer",
                    gated_mlp=False, mlp_seq=("dense_h_to_4h", "gelu_impl", "dense_4h_to_h"), alibi=True,
                    eager_output=True, block_tuple=True, eager_only=True,
                    qkv_per_head="query_key_value"),
    # Falcon (rotary form: falcon-7b, alibi=False, new_decoder_architecture=False): one input_layernorm before both
    # sublayers (parallel_attn; the serial form, parallel_attn=False, is the pre-norm layout: `family_of`), a fused
    # query_key_value ([q heads | k | v] with multi_query, else [q | k | v] within each head), dense, GELU MLP
    "falcon": Family("Falcon", layout="parallel", ln2="input_layernorm", layers_attr="h", attn_attr="self_attention",
                     embed_attr="word_embeddings", final_norm_attr="ln_f", norm_kind="layer", gated_mlp=False,
                     proj=("dense", "dense_h_to_4h", "dense_4h_to_h"), block_tuple=True,
                     own_attention="falcon"),
    # GPT-Neo (TinyStories, gpt-neo-125m ... 2.7b): GPT-2's learned table and LayerNorms, layers alternating global and
    # local (a window of window_size keys) attention, scores q.k without the 1/sqrt(D) scaling, q/k/v/out_proj Linear
    # (out_proj with a bias), MLP c_fc/c_proj; the attention inside a wrapper (attn.attention), eager only
    "gpt_neo": Family("GPT-Neo", ln1="ln_1", ln2="ln_2", layers_attr="h", attn_attr="attn.attention", embed_attr="wte",
                      pos_embed_attr="wpe", final_norm_attr="ln_f", norm_kind="layer", gated_mlp=False,
                      proj=("out_proj", "c_fc", "c_proj"), eager_output=True, block_tuple=True, eager_only=True,
                      own_attention="gpt_neo", windows_in_module=True),
    # MPT (mpt-7b, mpt-30b and their instruct, chat and storywriter forms): ALiBi in every layer (transformers' MPT
    # builds the bias for max_seq_len keys: slope_h * (j - (T' - 1)) at key j of T', relative to the last key),
    # LayerNorms with a weight and no bias, a fused Wqkv ([q | k | v], whole projections), no biases, a GELU MLP
    # (ffn.up_proj, ffn.down_proj; the ffn adds the residual itself); its attention is its own code (poslens runs a
    # copy); eager only
    "mpt": Family("MPT", ln1="norm_1", ln2="norm_2", layers_attr="blocks", attn_attr="attn", embed_attr="wte",
                  final_norm_attr="norm_f", norm_kind="layer", gated_mlp=False, mlp_attr="ffn",
                  mlp_seq=("up_proj", "act", "down_proj"), alibi=True, alibi_from_mask=False, eager_output=True,
                  block_tuple=True, eager_only=True, own_attention="mpt"),
    # StableLM (stablelm-2, stablelm-3b-4e1t, stablelm-zephyr): Llama's block with LayerNorms (weight and bias) and
    # partial rotary (partial_rotary_factor: a quarter of each head); stablelm-2-12b's parallel and per-head q/k norm
    # form: `_stablelm_family`
    "stablelm": Family("StableLM", norm_kind="layer"),
    # Starcoder2 (starcoder2-3b, -7b, -15b): Llama's block with LayerNorms (weight and bias), biases on q/k/v/o
    # (use_bias), a GELU MLP without a gate (c_fc, c_proj) and a sliding window in every layer (sliding_window)
    "starcoder2": Family("Starcoder2", norm_kind="layer", gated_mlp=False),
    # OLMo (1): Llama's block with LayerNorms without weight or bias (OlmoLayerNorm, eps 1e-5); its clip_qkv clamps
    # q, k and v in place after their projections
    "olmo": Family("OLMo", norm_kind="layer", clip_qkv_in_place=True),
    # OLMo-2: no norm before a sublayer; ln1/ln2 are the norms of the sublayers' outputs (TransformerLens's names)
    "olmo2": Family("OLMo-2", layout="post-norm", ln1="post_attention_layernorm", ln2="post_feedforward_layernorm",
                    norm_gain="weight-float32", qk_norm_whole=True, per_head_inputs=False),
    # rotary on part of each head and a parallel residual, LayerNorm with bias, an MLP without a gate:
    # GPT-NeoX (Pythia): rotary_pct of each head, fused per-head [q | k | v], untied embed_out (the serial form,
    # use_parallel_residual=False, is the pre-norm layout: `family_of`)
    "gpt_neox": Family("GPT-NeoX", layout="parallel", attn_attr="attention", embed_attr="embed_in",
                       final_norm_attr="final_layer_norm", norm_kind="layer", gated_mlp=False,
                       proj=("dense", "dense_h_to_4h", "dense_4h_to_h"), qkv_per_head="query_key_value"),
    # GPT-J: rotary_dim dims turned in adjacent pairs, one ln_1 before both sublayers, q/k/v/out without biases
    "gptj": Family("GPT-J", layout="parallel", ln1="ln_1", ln2="ln_1", layers_attr="h", attn_attr="attn",
                   embed_attr="wte", final_norm_attr="ln_f", norm_kind="layer", gated_mlp=False,
                   proj=("out_proj", "fc_in", "fc_out"), rotary_adjacent_pairs=True, rotary_sin_first=True),
    # Cohere (Command-R; Command-R+'s use_qk_norm: a LayerNorm of each head's q and k) and Cohere2 (Command-R7B: RoPE
    # in its sliding-window layers, none in the full-attention ones): one input_layernorm before a parallel attention
    # and gated SiLU MLP, summed (x + attn) + mlp; a LayerNorm with a weight and no bias (in float32); RoPE on
    # interleaved pairs; the LM head's logits times logit_scale
    "cohere": Family("Cohere", layout="parallel", ln2="input_layernorm", norm_kind="layer",
                     rotary_adjacent_pairs=True, residual_first=True),
    "cohere2": Family("Cohere2", layout="parallel", ln2="input_layernorm", norm_kind="layer",
                      rotary_adjacent_pairs=True, residual_first=True),
    # mixtures of experts on Llama's block (`Family.moe`): Mixtral (Mistral's attention; top-k weights always
    # renormalised), Qwen2-MoE (Qwen2's; a shared expert through a sigmoid gate), Qwen3-MoE (Qwen3's per-head q/k
    # RMSNorms), OLMoE (q/k RMSNorms over the whole projections, as OLMo-2's, in a pre-norm block)
    "mixtral": Family("Mixtral", moe=True),
    "qwen2_moe": Family("Qwen2-MoE", moe=True),
    "qwen3_moe": Family("Qwen3-MoE", moe=True),
    "olmoe": Family("OLMoE", moe=True, qk_norm_whole=True),
    # Phi (phi-1, phi-1.5, phi-2): partial_rotary_factor, one input_layernorm before both sublayers, biases
    "phi": Family("Phi", layout="parallel", ln2="input_layernorm", final_norm_attr="final_layernorm",
                  norm_kind="layer", gated_mlp=False, proj=("dense", "fc1", "fc2")),
}

# Checkpoints known to be trained without positional encoding but saved as RoPE architectures (lower-case hub ids).
KNOWN_NOPE: dict[str, str] = {
    "starmpcc/nope_1.5b_fw_edu_15t": "Kim et al. 2025 (Section 4.2): a Llama trained with apply_rotary_pos_emb "
                                     "replaced by the identity, saved as a plain Llama",
}


def family_of(config: Any) -> Family:
    """The family of a transformers config; a one-line UsageError for anything unsupported."""
    model_type = getattr(config, "model_type", None)
    if model_type == "gemma3":
        raise UsageError("model_type 'gemma3' is the multimodal Gemma-3; load its text model (Gemma3ForCausalLM, "
                         "model_type 'gemma3_text') instead")
    if model_type not in FAMILIES:
        raise UsageError(f"model_type {model_type!r} is not supported; supported: {', '.join(FAMILIES)}")
    if model_type == "opt":
        _check_opt(config)
    if model_type == "bloom":
        _check_bloom(config)
    if model_type == "gptj":
        _check_gptj(config)
    if model_type == "mpt":
        _check_mpt(config)
    if model_type == "olmoe" and getattr(config, "clip_qkv", None) is not None:
        raise UsageError("OLMoE with clip_qkv is not supported (its clamp of q and k comes after their norms); "
                         "OLMoE-1B-7B's config sets none")
    if getattr(config, "use_bidirectional_attention", False) or not getattr(config, "is_causal", True):
        raise UsageError(f"model_type {model_type!r} with bidirectional attention is not supported (causal only)")
    if model_type == "stablelm":
        return _stablelm_family(config)
    if model_type in ("gpt_neox", "phi"):
        return _partial_rotary_family(config, FAMILIES[model_type])
    if model_type == "falcon":
        return _falcon_family(config)
    if model_type == "gpt_bigcode":
        return _gpt_bigcode_family(config)
    return FAMILIES[model_type]


def _check_gptj(config: Any) -> None:
    """GPT-J rotates the first rotary_dim dimensions of each head: at most the head's width, and even."""
    head = config.n_embd // config.n_head
    rotary = getattr(config, "rotary_dim", None)
    if rotary is not None and (rotary > head or rotary % 2):
        raise UsageError(f"GPT-J rotary_dim {rotary} must be even and at most the head width n_embd / n_head = "
                         f"{head}; set rotary_dim in the config (GPTJConfig's default is 64)")


def _check_mpt(config: Any) -> None:
    """Refuse, in one line, the MPT forms that transformers' MPT does not run as configured (it always adds ALiBi,
    never q/k LayerNorms, never a prefix-LM mask): poslens would measure another model than the checkpoint's."""
    attn = getattr(config, "attn_config", None)
    get = (lambda k, d: attn.get(k, d)) if isinstance(attn, dict) else (lambda k, d: getattr(attn, k, d))
    if not get("alibi", True):
        raise UsageError("MPT with attn_config.alibi=False is not supported: transformers' MPT adds ALiBi in every "
                         "layer whatever the config says (the ALiBi checkpoints, mpt-7b and mpt-30b, are)")
    if get("alibi_bias_max", 8) != 8:
        raise UsageError(f"MPT with attn_config.alibi_bias_max={get('alibi_bias_max', 8)} is not supported: "
                         "transformers' MPT builds its ALiBi slopes with 8 whatever the config says (mpt-7b's and "
                         "mpt-30b's is 8)")
    for field, what in (("qk_ln", "q/k LayerNorms"), ("prefix_lm", "a prefix-LM mask"),
                        ("attn_uses_sequence_id", "per-sequence masks")):
        if get(field, False):
            raise UsageError(f"MPT with attn_config.{field}=True is not supported: transformers' MPT runs no "
                             f"{what}, so it would not be the model the config describes")


def _stablelm_family(config: Any) -> Family:
    """StableLM's serial form (stablelm-2-1.6b, stablelm-3b-4e1t), or stablelm-2-12b's: a parallel residual (one
    input_layernorm, summed (x + attn) + mlp) and a LayerNorm of each head's q and k (qk_layernorm: q_layernorm,
    k_layernorm, one LayerNorm per head on [B, heads, T, D])."""
    family = FAMILIES["stablelm"]
    if getattr(config, "use_parallel_residual", False):
        family = replace(family, layout="parallel", ln2="input_layernorm", residual_first=True)
    if getattr(config, "qk_layernorm", False):
        family = replace(family, qk_norm_attrs=("q_layernorm", "k_layernorm"), qk_norm_heads_first=True)
    return family


def _partial_rotary_family(config: Any, family: Family) -> Family:
    """GPT-NeoX in its serial form (use_parallel_residual=False: x + attn(ln1(x)), then + mlp(ln2(.))) is the pre-norm
    layout; Phi's optional LayerNorm of q and k is refused in one line."""
    if getattr(config, "qk_layernorm", False):
        raise UsageError("Phi with qk_layernorm=True (a LayerNorm of each head's q and k) is not supported; the phi-1, "
                         "phi-1.5 and phi-2 checkpoints have none")
    if family.layout == "parallel" and not getattr(config, "use_parallel_residual", True):
        return replace(family, layout="pre-norm")
    return family


def _check_opt(config: Any) -> None:
    """Refuse, in one line, the OPT forms poslens does not hook: post-LN (OPT-350m's do_layer_norm_before=False),
    project_in/out (a word embedding narrower than the model), LayerNorms without gain and bias, no final norm."""
    hidden = config.hidden_size
    if not getattr(config, "do_layer_norm_before", True):
        raise UsageError("OPT with do_layer_norm_before=False (OPT-350m's post-LN form) is not supported; the pre-LN "
                         "OPT checkpoints (125m, 1.3b, 2.7b, ...) are")
    if getattr(config, "word_embed_proj_dim", hidden) != hidden:
        raise UsageError(f"OPT with word_embed_proj_dim {config.word_embed_proj_dim} != hidden_size {hidden} "
                         "(project_in/project_out, OPT-350m) is not supported; OPT with embeddings as wide as the "
                         "model is")
    if not getattr(config, "layer_norm_elementwise_affine", True) or getattr(config, "_remove_final_layer_norm",
                                                                                False):
        raise UsageError("OPT without LayerNorm gains and biases, or without its final LayerNorm, is not supported")


def _check_bloom(config: Any) -> None:
    """Refuse, in one line, the BLOOM forms poslens does not hook."""
    if getattr(config, "apply_residual_connection_post_layernorm", False):
        raise UsageError("BLOOM with apply_residual_connection_post_layernorm=True is not supported (the residual "
                         "taken after the norm); the released BLOOM checkpoints have False")
    if getattr(config, "pretraining_tp", 1) > 1 and getattr(config, "slow_but_exact", False):
        raise UsageError("BLOOM with slow_but_exact=True and pretraining_tp > 1 is not supported (its sliced "
                         "projections); load it with slow_but_exact=False")


def _falcon_family(config: Any) -> Family:
    """Falcon's forms with one norm per block (falcon-7b's parallel_attn, or serial: the pre-norm layout, its
    input_layernorm and post_attention_layernorm), rotary or ALiBi (falcon-rw); the new decoder architecture
    (falcon-40b/180b, falcon-11B: grouped key/value heads, ln_attn and ln_mlp before a parallel attention and MLP, or
    one input_layernorm with num_ln_in_parallel_attn=1); the ALiBi form under eager attention is refused in one line
    (transformers' eager Falcon adds the bias twice: in the scores and in the mask), and so is ALiBi with the new
    architecture (no checkpoint has it)."""
    alibi = bool(getattr(config, "alibi", False))
    if getattr(config, "new_decoder_architecture", False):
        if alibi:
            raise UsageError("Falcon with new_decoder_architecture=True and alibi=True is not supported (no released "
                             "checkpoint has both); the new architecture's rotary form is (falcon-40b, falcon-11B)")
        two = getattr(config, "num_ln_in_parallel_attn", None) in (None, 2)  # transformers' default: 2
        return replace(FAMILIES["falcon"], **(dict(ln1="ln_attn", ln2="ln_mlp") if two else {}))
    if alibi and getattr(config, "_attn_implementation", None) == "eager":
        raise UsageError("Falcon with alibi=True under eager attention is not supported: transformers' eager Falcon "
                         "adds the ALiBi bias twice (SDPA adds it once, as falcon-rw was trained); load it with sdpa")
    family = replace(FAMILIES["falcon"], alibi=alibi)
    if not getattr(config, "parallel_attn", True):
        return replace(family, layout="pre-norm", ln2="post_attention_layernorm")
    return family


def _gpt_bigcode_family(config: Any) -> Family:
    """GPT-BigCode's multi-query form (StarCoder, SantaCoder: c_attn [q heads | k | v]) or its multi-head one (each
    head's [q | k | v] side by side, as GPT-NeoX's); cross-attention refused in one line."""
    if getattr(config, "add_cross_attention", False):
        raise UsageError("GPT-BigCode with add_cross_attention=True is not supported (a decoder-only causal LM is)")
    family = FAMILIES["gpt_bigcode"]
    return family if getattr(config, "multi_query", True) else replace(family, qkv_per_head="c_attn")


def attention_implementation(config: Any, requested: str) -> str:
    """The attention implementation to load a model of `config` with: `requested`, or "eager" for a family that has
    no other (BLOOM, Gemma-2); Falcon's ALiBi form is refused with "eager" (`_falcon_family`)."""
    family = family_of(config)
    if family.own_attention == "falcon" and family.alibi and requested == "eager":
        raise UsageError("attn_implementation eager: transformers' eager Falcon adds the ALiBi bias twice (SDPA adds "
                         "it once, as falcon-rw was trained); use sdpa")
    return "eager" if family.eager_only else requested


def base_part(model: nn.Module, path: str) -> nn.Module:
    """The submodule of the model's base model at `path` (a Family attribute; dotted for OPT's "decoder.layers")."""
    return model.base_model.get_submodule(path)


def mlp_module(family: Family, layer: nn.Module) -> nn.Module:
    """The module holding a decoder layer's MLP projections (OPT: the layer itself, fc1 and fc2)."""
    return getattr(layer, family.mlp_attr) if family.mlp_attr else layer


def mlp_block(family: Family, layer: nn.Module) -> nn.Module:
    """A decoder layer's MLP as one module, x -> mlp(x) (OPT, BLOOM: its up projection, activation and down
    projection in a Sequential that shares them; dropout is the identity in eval)."""
    holder = mlp_module(family, layer)
    if family.mlp_seq is None:
        return holder
    return nn.Sequential(*(getattr(holder, name) for name in family.mlp_seq))


def sparse_mlp(family: Family, layer: nn.Module) -> nn.Module | None:
    """A decoder layer's mixture-of-experts block (its router `gate` and fused `experts`), or None where the layer's
    MLP is dense."""
    mlp = getattr(layer, family.mlp_attr, None) if family.moe else None
    return mlp if mlp is not None and hasattr(mlp, "experts") else None


def float64_copy(module: nn.Module) -> nn.Module:
    """A float64 copy of one of a model's modules; a mixture of experts' copy runs transformers' eager loop over the
    experts (its default grouped_mm kernel refuses float64)."""
    twin = copy.deepcopy(module).double()
    for part in twin.modules():
        config = getattr(part, "config", None)  # the copy's own config (copied with it)
        if getattr(config, "_experts_implementation", None) not in (None, "eager"):
            config._experts_implementation = "eager"
    return twin


def check_supported(config: Any) -> None:
    """Raise UsageError unless `config` is an architecture poslens handles."""
    family_of(config)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM (or of its base model)."""
    return base_part(model, family_of(model.config).layers_attr)


def attention_module(model: nn.Module, layer: int) -> nn.Module:
    """The attention module of decoder layer `layer`."""
    return layer_attention(family_of(model.config), decoder_layers(model)[layer])


PARAMETER_FREE_LN_EPS = 1e-5  # OLMo (1)'s OlmoLayerNorm: F.layer_norm without weight or bias, its eps fixed at 1e-5


def norm_eps(norm: nn.Module) -> float:
    """The epsilon a norm adds to the variance (OLMo's parameter-free LayerNorm holds none; StableLM's per-head q/k
    norm, its heads' LayerNorms')."""
    if hasattr(norm, "norms"):
        return norm_eps(norm.norms[0])
    for name in ("eps", "variance_epsilon"):
        if hasattr(norm, name):
            return float(getattr(norm, name))
    return PARAMETER_FREE_LN_EPS


def norm_affine(norm: nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A norm's (weight, bias) (None where it has none: an RMSNorm's bias, OLMo's parameter-free LayerNorm's both);
    StableLM's per-head q/k norm (one LayerNorm per head): its heads' stacked, [heads, D]."""
    if hasattr(norm, "norms"):
        weight, bias = zip(*(norm_affine(n) for n in norm.norms))
        return (None if weight[0] is None else torch.stack(weight)), (None if bias[0] is None else torch.stack(bias))
    return getattr(norm, "weight", None), getattr(norm, "bias", None)


def layer_attention(family: Family, layer: nn.Module) -> nn.Module:
    """The attention module of a decoder layer (the one holding the q, k, v and output projections; GPT-Neo's sits
    inside a wrapper: `attn.attention`)."""
    return layer.get_submodule(family.attn_attr)


def layer_index(attn: nn.Module) -> int:
    """The index of an attention module's layer (GPT-Neo names it `layer_id`)."""
    return int(attn.layer_idx if hasattr(attn, "layer_idx") else attn.layer_id)


def head_dim(attn: nn.Module) -> int:
    """The head width of an attention module (GPT-NeoX's is `head_size`)."""
    return int(getattr(attn, "head_dim", None) or attn.head_size)


def kv_heads(config: Any) -> int:
    """The number of key/value heads (Falcon's and GPT-BigCode's multi_query: 1; no num_key_value_heads: one per query
    head)."""
    model_type = getattr(config, "model_type", None)
    if model_type == "falcon" and getattr(config, "new_decoder_architecture", False):  # grouped key/value heads
        return int(config.num_kv_heads)
    if model_type == "falcon" and getattr(config, "multi_query", False):
        return 1
    if model_type == "gpt_bigcode":  # (its config's num_key_value_heads is a default the model never reads)
        return 1 if getattr(config, "multi_query", True) else int(config.num_attention_heads)
    return int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)


def num_layers(model_or_config: Any) -> int:
    config = getattr(model_or_config, "config", model_or_config)
    return int(config.num_hidden_layers)


def sliding_windows(config: Any) -> list[int]:
    """Per layer, the sliding window in tokens (0 = full causal attention), as the attention modules use it."""
    return list(PositionalEncoding.of(config).windows)


def rotary_modules(model: nn.Module) -> list[nn.Module]:
    """The rotary-embedding modules of `model` (transformers' `*RotaryEmbedding` classes)."""
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def positional_encoding(model_or_config: Any) -> list[str]:
    """Per layer: "rope", "partial-rope", "learned", "alibi" or "none" (a model loaded with pe="none" is "none"
    everywhere).
    The whole encoding (RoPE base and scaling, sliding windows, a label) is
    `poslens.engine.pe.PositionalEncoding.of`."""
    return list(PositionalEncoding.of(model_or_config).rope)


def positional_encoding_record(model_or_config: Any) -> dict[str, Any]:
    """The model's positional encoding as run.json records it (`PositionalEncoding.record`)."""
    return PositionalEncoding.of(model_or_config).record()


def known_nope(spec: str) -> str | None:
    """Why a model spec is known to be NoPE (a hub id in KNOWN_NOPE), else None."""
    return KNOWN_NOPE.get(spec.strip().lower())


def embedding_scale(model: nn.Module) -> float:
    """The factor between a row of the input embedding matrix and what the decoder receives for that token (the
    value at the hook point `hook_embed`, the embedding module's output): Gemma-2 and Gemma-3 multiply the looked-up
    row by sqrt(hidden_size) inside their embedding module (`embed_scale`, cast to the weights' dtype as the module
    casts it); every other family by 1. A vector written at position 0 in place of an embedding row (the leakage
    interventions' `mean`, `token:ID`) is multiplied by it, so it enters at the model's scale."""
    module = model.get_input_embeddings()
    scale = getattr(module, "embed_scale", None)
    if scale is None:
        return 1.0
    return float(torch.as_tensor(scale).to(module.weight.dtype))


def embedded_rows(model: nn.Module, rows: torch.Tensor) -> torch.Tensor:
    """What hook_embed holds for embedding rows `rows` [..., d] (float32): the rows times `embedding_scale`, and on
    BLOOM through its LayerNorm after the embedding (TransformerLens's hook_embed comes after it)."""
    out = rows * embedding_scale(model)
    family = family_of(model.config)
    if family.embed_norm_attr:
        norm = base_part(model, family.embed_norm_attr)
        with torch.no_grad():
            out = norm(out.to(norm.weight.dtype)).float()
    return out


def _identity_rotation(module: nn.Module, args, output):
    cos, sin = output
    return cos.new_ones(cos.shape), sin.new_zeros(sin.shape)


def _identity_rotation_sin_first(module: nn.Module, args, output):
    sin, cos = output  # GPT-J's rotary module returns (sin, cos)
    return sin.new_zeros(sin.shape), cos.new_ones(cos.shape)


def remove_rope(model: nn.Module) -> list:
    """Make every rotary embedding of `model` the identity (cos = 1, sin = 0); returns the hook handles."""
    modules = rotary_modules(model)
    if not modules:
        raise UsageError(f"{type(model).__name__} has no rotary embedding module to remove")
    hook = _identity_rotation_sin_first if family_of(model.config).rotary_sin_first else _identity_rotation
    return [m.register_forward_hook(hook) for m in modules]


def alibi_builder(base: nn.Module) -> Callable[..., torch.Tensor]:
    """The function `base` (a base model) builds its ALiBi tensor with, (mask [B, T], heads, dtype) -> [B * H, 1, T]:
    BLOOM's method (or what replaces it on the instance); Falcon's module function, which transformers calls by its
    module-level name: that name is made, once, to defer to a `build_alibi_tensor` set on the calling FalconModel
    instance (the caller's `self`), so a replacement set there acts as on BLOOM."""
    if not type(base).__name__.startswith("Falcon"):
        return base.build_alibi_tensor
    module = importlib.import_module(type(base).__module__)
    original = getattr(module, "poslens_build_alibi_tensor", None)
    if original is None:
        original = module.poslens_build_alibi_tensor = module.build_alibi_tensor

        def dispatch(mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
            own = getattr(sys._getframe(1).f_locals.get("self"), "__dict__", {}).get("build_alibi_tensor")
            return (own or original)(mask, num_heads, dtype)

        module.build_alibi_tensor = dispatch
    return base.__dict__.get("build_alibi_tensor") or original


def scale_alibi(model: nn.Module, factor: float):
    """Multiply every ALiBi slope of `model` (BLOOM, MPT, Falcon's ALiBi form) by `factor` in every forward until the
    returned function is called (0: the model without ALiBi). The model's own code builds the bias, from its [B, T]
    mask, times `factor` (transformers builds BLOOM's inline, not by that method, when no mask is given: a forward
    without one gets the all-ones mask, the same causal mask)."""
    if "alibi" not in positional_encoding(model):
        raise UsageError(f"{family_of(model.config).name} has no ALiBi slopes to scale")
    base = model.base_model
    if not family_of(model.config).alibi_from_mask:  # MPT: its method (heads, keys, ...) -> [H, 1, keys]
        return _scaled_method(base, "build_mpt_alibi_tensor", factor)
    restore = _scaled_method(base, "build_alibi_tensor", factor, alibi_builder(base))

    def with_mask(module, args, kwargs):
        if kwargs.get("attention_mask") is not None:
            return None
        ids = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else (args[0] if args else None)
        shape = ids.shape if ids is not None else kwargs["inputs_embeds"].shape[:2]
        device = (ids if ids is not None else kwargs["inputs_embeds"]).device
        return args, {**kwargs, "attention_mask": torch.ones(shape, dtype=torch.long, device=device)}

    handle = base.register_forward_pre_hook(with_mask, with_kwargs=True)

    def undo() -> None:
        handle.remove()
        restore()

    return undo


def _scaled_method(obj: Any, name: str, factor: float, inner: Callable[..., Any] | None = None) -> Callable[[], None]:
    """Make `obj.name(...)` return `inner`'s result (default: the method's own) times `factor`, as an attribute on the
    instance over any earlier one; returns the function that puts the earlier one back."""
    previous = obj.__dict__.get(name)
    inner = inner or getattr(obj, name)
    setattr(obj, name, lambda *args, **kwargs: inner(*args, **kwargs) * factor)

    def undo() -> None:
        if previous is None:
            delattr(obj, name)
        else:
            setattr(obj, name, previous)

    return undo


def set_positional_encoding(model: nn.Module, pe: str) -> None:
    """Apply a loader's `pe` choice to a loaded model: "none" removes RoPE for the model's lifetime; "rope" and
    "auto" leave it as the config says ("rope" refused where no layer has RoPE)."""
    if pe not in PE_CHOICES:
        raise UsageError(f"pe must be one of {', '.join(PE_CHOICES)}; got {pe!r}")
    schemes = positional_encoding(model)
    if pe == "rope" and not any(p in ("rope", "partial-rope") for p in schemes):
        source = {"learned": "a learned table added to the token embeddings", "alibi": "ALiBi's biases in the scores",
                  "none": "the causal mask alone (no positional encoding)"}
        raise UsageError(f"pe rope keeps a model's RoPE, and this {family_of(model.config).name} model has none: its "
                         f"positions come from {', '.join(source.get(p, p) for p in dict.fromkeys(schemes))}; load "
                         "it with pe auto")
    if pe == "none" and "learned" in schemes:
        raise UsageError(f"pe none removes RoPE, and this {family_of(model.config).name} model has none: its positions "
                         "come from a learned table added to the token embeddings; load it with pe auto")
    if pe == "none" and "alibi" in schemes:  # BLOOM: every slope 0 for the model's lifetime
        scale_alibi(model, 0.0)
        setattr(model, PE_ATTR, "none")
        return
    if pe == "none" and getattr(model, PE_ATTR, None) != "none":
        if all(p == "none" for p in positional_encoding(model)):
            return  # already NoPE by its config (SmolLM3 with no_rope_layers all 0)
        remove_rope(model)
        setattr(model, PE_ATTR, "none")
