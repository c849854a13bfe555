"""Tiny random causal LMs of every supported family, built from configs (never downloaded).

Each builder returns a float32 `...ForCausalLM` in eval mode with deterministic weights (seeded), a few layers,
a small hidden size and grouped-query attention. The query/key weights are rescaled so the pre-softmax scores
have the magnitude of a trained LLM (standard deviation of a few units) instead of the ~0.03 of a fresh
initialisation, which would make every attention map flat and every comparison trivially pass.

    model = build("qwen3")                   # any of FAMILIES
    model = build("mistral", sliding_window=8, num_hidden_layers=2)   # config overrides
    model = build("gpt2")                    # any of ALL_FAMILIES (FAMILIES: the RoPE/NoPE ones)
"""

from __future__ import annotations

import copy

import torch
from transformers import (
    BloomConfig,
    BloomForCausalLM,
    Cohere2Config,
    Cohere2ForCausalLM,
    CohereConfig,
    CohereForCausalLM,
    FalconConfig,
    FalconForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GemmaConfig,
    GemmaForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    GPTJConfig,
    GPTJForCausalLM,
    GPTNeoConfig,
    GPTNeoForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    MptConfig,
    MptForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    OlmoConfig,
    OlmoeConfig,
    OlmoeForCausalLM,
    OlmoForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PhiConfig,
    PhiForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
    StableLmConfig,
    StableLmForCausalLM,
    Starcoder2Config,
    Starcoder2ForCausalLM,
)

VOCAB = 256
SCORE_STD = 3.0  # target standard deviation of q.k * scaling at the first layer

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

# family -> (config class, model class, family-specific config fields)
SPECS: dict[str, tuple[type, type, dict]] = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),  # q/k/v biases
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {}),  # RMSNorm on q and k before RoPE
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": 12}),
    "phi3": (
        Phi3Config,
        Phi3ForCausalLM,
        {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
    ),
    "smollm3": (SmolLM3Config, SmolLM3ForCausalLM, {"no_rope_layers": [1, 0, 1]}),  # layer 1 without RoPE
    "gemma3": (
        Gemma3TextConfig,
        Gemma3ForCausalLM,
        {
            "sliding_window": 12,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,  # scaling 24**-0.5, not head_dim**-0.5
        },
    ),
    # Gemma (1): Llama's pre-norm block with Gemma's (1 + w) RMSNorm, sqrt(d)-scaled embeddings and a GeGLU MLP
    "gemma": (GemmaConfig, GemmaForCausalLM, {}),
    "gemma2": (
        Gemma2Config,
        Gemma2ForCausalLM,
        {
            "sliding_window": 12,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "query_pre_attn_scalar": 24,
            "attn_logit_softcapping": 8.0,  # small enough that tanh capping visibly bends the scores
            "final_logit_softcapping": 30.0,
        },
    ),
    # StableLM: Llama's block with LayerNorms (weight and bias), a quarter of each head rotated (4 of 16), q/k/v biases
    "stablelm": (StableLmConfig, StableLmForCausalLM, {"use_qkv_bias": True, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}}),
    # Starcoder2: Llama's block with LayerNorms, biases, a GELU MLP without a gate, a window of 12 keys in every layer
    "starcoder2": (Starcoder2Config, Starcoder2ForCausalLM, {"sliding_window": 12, "use_bias": True,
                                                             "hidden_act": "gelu_pytorch_tanh"}),
    # Cohere: one LayerNorm (no bias) before a parallel attention and gated MLP, summed (x + attn) + mlp; RoPE on
    # interleaved pairs; logits times logit_scale. Cohere2: RoPE in the sliding-window layers (window 12) only
    "cohere": (CohereConfig, CohereForCausalLM, {"logit_scale": 0.25, "tie_word_embeddings": True}),
    "cohere2": (Cohere2Config, Cohere2ForCausalLM, {"logit_scale": 0.25, "tie_word_embeddings": True,
                                                    "sliding_window": 12, "layer_types": [
                                                        "sliding_attention", "full_attention", "sliding_attention"]}),
    # OLMo (1): Llama's block with LayerNorms without weight or bias; full multi-head attention, as the checkpoints
    "olmo": (OlmoConfig, OlmoForCausalLM, {"num_key_value_heads": 4}),
    # post-norm, RMSNorm of the whole q and k projections; full multi-head attention, as the OLMo-2 checkpoints
    "olmo2": (Olmo2Config, Olmo2ForCausalLM, {"num_key_value_heads": 4}),
    # mixtures of experts on Llama's block: 4 experts of 48, 2 chosen per token. Mixtral (top 2 renormalised);
    # Qwen2-MoE (q/k/v biases, a shared expert of 96 through a sigmoid gate, layer 1 dense: mlp_only_layers);
    # Qwen3-MoE (per-head q/k RMSNorms, top k renormalised); OLMoE (q/k RMSNorms of the whole projections, full
    # multi-head attention as OLMoE-1B-7B)
    "mixtral": (MixtralConfig, MixtralForCausalLM, {"num_local_experts": 4, "num_experts_per_tok": 2,
                                                    "intermediate_size": 48}),
    "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM, {"num_experts": 4, "num_experts_per_tok": 2,
                                                        "moe_intermediate_size": 48,
                                                        "shared_expert_intermediate_size": 96,
                                                        "mlp_only_layers": [1]}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {"num_experts": 4, "num_experts_per_tok": 2,
                                                        "moe_intermediate_size": 48, "norm_topk_prob": True}),
    "olmoe": (OlmoeConfig, OlmoeForCausalLM, {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48,
                                              "num_key_value_heads": 4}),
    # learned absolute positions (wpe), LayerNorm with bias, Conv1D c_attn [q | k | v]; 64 wide = 4 heads of 16, an
    # MLP 4 x 64 wide (GPT-2's n_inner default, which TransformerLens assumes)
    # (None: a common field GPT-2's config does not have)
    "gpt2": (GPT2Config, GPT2LMHeadModel, {"max_position_embeddings": 64, "activation_function": "gelu_new",
                                           "tie_word_embeddings": True,
                                           "num_key_value_heads": None, "head_dim": None, "intermediate_size": None}),
    # GPT-BigCode (StarCoder): GPT-2's learned table and LayerNorms, Linear projections, multi-query attention (c_attn
    # [q heads | k | v]); MLP 4 x 64 wide
    "gpt_bigcode": (GPTBigCodeConfig, GPTBigCodeForCausalLM, {"max_position_embeddings": 64, "multi_query": True,
                                                              "activation_function": "gelu_pytorch_tanh",
                                                              "tie_word_embeddings": True, "num_key_value_heads": None,
                                                              "head_dim": None, "intermediate_size": None}),
    "gpt_bigcode_mha": (GPTBigCodeConfig, GPTBigCodeForCausalLM, {  # its multi-head form: each head's [q | k | v]
        "max_position_embeddings": 64, "multi_query": False, "activation_function": "gelu_pytorch_tanh",
        "tie_word_embeddings": True, "num_key_value_heads": None, "head_dim": None, "intermediate_size": None}),
    # GPT-Neo: GPT-2's learned table and LayerNorms, layers global, local (a window of 12 keys), global; scores without
    # the 1/sqrt(D) scaling; q/k/v/out_proj Linear, MLP 4 x 64 wide (intermediate_size unset, which TransformerLens
    # assumes); eager attention only
    "gpt_neo": (GPTNeoConfig, GPTNeoForCausalLM, {"num_layers": 3, "num_heads": 4, "window_size": 12,
                                                  "attention_types": [[["global", "local"], 1], [["global"], 1]],
                                                  "max_position_embeddings": 64, "tie_word_embeddings": True,
                                                  "num_hidden_layers": None, "num_attention_heads": None,
                                                  "num_key_value_heads": None, "head_dim": None,
                                                  "intermediate_size": None}),
    # MPT: ALiBi (relative to the last key), LayerNorms without biases, a fused Wqkv [q | k | v], no biases, a GELU MLP
    # 4 x 64 wide; a table of 64 ALiBi positions (max_seq_len); eager attention only
    "mpt": (MptConfig, MptForCausalLM, {"max_seq_len": 64, "num_key_value_heads": None, "head_dim": None,
                                        "intermediate_size": None, "max_position_embeddings": None}),
    # rotary on part of each head and a parallel residual (full multi-head attention, as the checkpoints):
    # GPT-NeoX (Pythia): rotary_pct 0.25 (Pythia's) of 16 dims, per-head fused [q | k | v] with biases, untied embed_out
    "gpt_neox": (GPTNeoXConfig, GPTNeoXForCausalLM, {"rotary_pct": 0.25, "num_key_value_heads": None,
                                                      "head_dim": None}),
    # GPT-J: rotary_dim 8 of 16 turned in adjacent pairs, one ln_1, MLP 4 x 64 wide (n_inner unset, which
    # TransformerLens assumes)
    "gptj": (GPTJConfig, GPTJForCausalLM, {"rotary_dim": 8, "num_key_value_heads": None, "head_dim": None,
                                           "intermediate_size": None}),
    # Phi (phi-1/1.5/2): partial_rotary_factor 0.5 (phi-2: 0.4), one input_layernorm, q/k/v/dense with biases
    "phi": (PhiConfig, PhiForCausalLM, {"num_key_value_heads": 4, "rope_parameters": {
        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}),
    # learned absolute positions (decoder.embed_positions, looked up at position + 2), pre-LN LayerNorm with bias,
    # q/k/v/out_proj with biases (made random by `build`: a fresh OPT's are zeros), ReLU fc1/fc2 of ffn_dim
    "opt": (OPTConfig, OPTForCausalLM, {"max_position_embeddings": 64, "ffn_dim": 128, "tie_word_embeddings": True,
                                        "num_key_value_heads": None, "head_dim": None, "intermediate_size": None}),
    # ALiBi (4 heads: slopes 1/4, 1/16, 1/64, 1/256), a LayerNorm after the embedding, query_key_value [q | k | v]
    # within each head, GELU MLP 4 x 64; the config records no length (BLOOM's own: 2,048)
    "bloom": (BloomConfig, BloomForCausalLM, {"tie_word_embeddings": True, "num_key_value_heads": None,
                                              "head_dim": None, "intermediate_size": None,
                                              "max_position_embeddings": None}),
    # Falcon's rotary form as falcon-7b: multi-query (one key/value head), one input_layernorm before a parallel
    # attention and MLP (4 x 64 wide, GELU), no biases
    "falcon": (FalconConfig, FalconForCausalLM, {"multi_query": True, "parallel_attn": True, "bias": False,
                                                  "ffn_hidden_size": 256, "num_key_value_heads": None,
                                                  "head_dim": None, "intermediate_size": None}),
    # Falcon's new decoder architecture as falcon-40b: two key/value groups of two query heads (the fused rows grouped
    # [q, q, k, v] per group), ln_attn and ln_mlp before a parallel attention and MLP, no biases
    "falcon_new": (FalconConfig, FalconForCausalLM, {"new_decoder_architecture": True, "num_kv_heads": 2,
                                                      "parallel_attn": True, "bias": False, "ffn_hidden_size": 256,
                                                      "num_key_value_heads": None, "head_dim": None,
                                                      "intermediate_size": None}),
    # Falcon's ALiBi form as falcon-rw: serial attention and MLP, multi-head [q | k | v] within each head, biases
    "falcon_rw": (FalconConfig, FalconForCausalLM, {"alibi": True, "multi_query": False, "parallel_attn": False,
                                                     "bias": True, "ffn_hidden_size": 256, "num_key_value_heads": None,
                                                     "head_dim": None, "intermediate_size": None}),
}

ALL_FAMILIES: tuple[str, ...] = tuple(SPECS)
MOE: tuple[str, ...] = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")  # their experts' points: tests/test_moe.py
# the families of the RoPE/NoPE tests parametrised over FAMILIES (their float64 recomputations are Llama-like blocks);
# GPT-2 (learned positions, LayerNorm, Conv1D) is checked against TransformerLens itself (tests/test_family_tl.py)
FAMILIES: tuple[str, ...] = tuple(f for f in SPECS if f not in ("gpt2", "opt", "bloom", "gpt_neox", "gptj", "phi",
                                                                  "falcon", "falcon_rw", "falcon_new", "gpt_neo",
                                                                  "mpt",
                                                                  "gpt_bigcode", "gpt_bigcode_mha", "cohere",
                                                                  "cohere2", *MOE))


def config(family: str, **overrides):
    """The tiny config of `family` (see FAMILIES), with `overrides` applied."""
    config_cls, _, extra = SPECS[family]
    kwargs = {k: v for k, v in {**COMMON, **extra, **overrides}.items() if v is not None}
    return config_cls(**kwargs)


def build(family: str, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> PreTrainedModel:
    """A tiny random `family` model (eval mode, `dtype`), deterministic for a given seed and overrides."""
    cfg = config(family, **overrides)
    _, model_cls, _ = SPECS[family]
    attn = "eager" if family in ("gemma2", "bloom", "gpt_neo", "mpt") else "sdpa"  # BLOOM, GPT-Neo, MPT: eager only
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls._from_config(cfg, attn_implementation=attn, dtype=torch.float32)
        if family in ("opt", "bloom", "falcon_rw"):  # biases that matter: every Linear's, as trained OPT
            # checkpoints have
            for m in model.modules():
                if isinstance(m, torch.nn.Linear) and m.bias is not None:
                    torch.nn.init.normal_(m.bias, 0.0, 0.1)
        _rescale_qk(model)
    if family in MOE:  # transformers' default experts kernel (grouped_mm) refuses float64, which the references run
        model.set_experts_implementation("eager")  # (tests/test_moe.py runs the default one too)
    return model.to(dtype).eval()


@torch.no_grad()
def _rescale_qk(model: PreTrainedModel) -> None:
    """Give every layer's q and k the spread that puts first-layer scores near SCORE_STD.

    score = scaling * sum_d q_d k_d has standard deviation ~ scaling * sqrt(D) * sq * sk for independent entries
    of spreads sq, sk; pick sq = sk = sqrt(SCORE_STD / (scaling * sqrt(D))). Without a q/k norm the spread comes
    from the projection (x has unit RMS after the input norm: sq = std(W) * sqrt(hidden)); with one it comes from
    the norm's gain (unit-RMS output times the gain).
    """
    cfg = model.config
    hidden = cfg.hidden_size
    base = model.base_model
    layers = getattr(base, "layers", None) or getattr(base, "h", None) or getattr(base, "blocks", None)  # MPT: blocks
    for layer in layers or base.decoder.layers:  # OPT: decoder
        attn = (getattr(layer, "self_attn", None) or getattr(layer, "self_attention", None)
                or getattr(layer, "attn", None) or layer.attention)  # BLOOM: self_attention; GPT-NeoX: attention
        attn = getattr(attn, "attention", attn)  # GPT-Neo: inside a wrapper
        d = getattr(attn, "head_dim", None) or attn.head_size  # GPT-NeoX: head_size
        scaling = (getattr(attn, "scaling", None) or getattr(attn, "inv_norm_factor", None)
                   or getattr(attn, "softmax_scale", None) or 1.0)  # BLOOM: inv_norm_factor; MPT: softmax_scale;
        # GPT-Neo: none (q.k as is)
        target = (SCORE_STD / (scaling * d**0.5)) ** 0.5
        if hasattr(attn, "q_norm"):
            gemma_style = "Gemma" in type(attn.q_norm).__name__  # RMSNorm output * (1 + weight)
            for norm in (attn.q_norm, attn.k_norm):
                gain = target * (1 + 0.1 * torch.randn_like(norm.weight))
                norm.weight.copy_(gain - 1 if gemma_style else gain)
        else:
            std = target / hidden**0.5
            if hasattr(attn, "Wqkv"):  # MPT: rows [q | k | v]
                attn.Wqkv.weight[: 2 * hidden].normal_(0.0, std)
            elif hasattr(attn, "c_attn") and type(attn.c_attn).__name__ == "Linear":  # GPT-BigCode: rows
                # [q heads | k | v] (multi_query), or [q | k | v] within each head
                rows = attn.c_attn.weight
                if getattr(attn, "multi_query", False):
                    rows[: hidden + d].normal_(0.0, std)
                else:
                    rows.unflatten(0, (cfg.num_attention_heads, 3, d))[:, :2].normal_(0.0, std)
            elif hasattr(attn, "c_attn"):  # GPT-2: a Conv1D, columns [q | k | v]
                attn.c_attn.weight[:, : 2 * hidden].normal_(0.0, std)
            elif getattr(attn, "new_decoder_architecture", False):  # Falcon-40b: groups of rows [q heads of the
                # group | k | v]
                g = cfg.num_attention_heads // attn.num_kv_heads
                attn.query_key_value.weight.unflatten(0, (attn.num_kv_heads, g + 2, d))[:, : g + 1].normal_(0.0, std)
            elif getattr(attn, "multi_query", False):  # Falcon's multi-query: rows [q heads | k | v]
                attn.query_key_value.weight[: (cfg.num_attention_heads + 1) * d].normal_(0.0, std)
            elif hasattr(attn, "query_key_value"):  # GPT-NeoX, BLOOM, Falcon without multi_query: rows [q | k | v]
                # within each head
                attn.query_key_value.weight.unflatten(0, (cfg.num_attention_heads, 3, d))[:, :2].normal_(0.0, std)
            elif hasattr(attn, "qkv_proj"):  # Phi-3: rows [q | k | v]
                n_qk = (cfg.num_attention_heads + cfg.num_key_value_heads) * d
                attn.qkv_proj.weight[:n_qk].normal_(0.0, std)
            else:
                attn.q_proj.weight.normal_(0.0, std)
                attn.k_proj.weight.normal_(0.0, std)


def eager_twin(model: PreTrainedModel, attn_implementation: str = "eager") -> PreTrainedModel:
    """A second model with `model`'s config and weights under transformers' eager attention (the scores, the softmax
    and pattern @ v as separate operations), for comparing a hooked forward whose attention output was computed from
    the pattern a hook read (or under `attn_implementation`). (Falcon cannot switch its implementation on a built
    model, hence a twin.)"""
    twin = type(model)._from_config(copy.deepcopy(model.config), attn_implementation=attn_implementation,
                                    dtype=model.dtype)
    twin.load_state_dict(model.state_dict())
    return twin.eval()


ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")  # a decoder layer's attention, by family
OUTPUT_NAMES = ("o_proj", "c_proj", "out_proj", "dense")  # its output projection W_O


def heads_summed_twin(model: PreTrainedModel, attn_implementation: str = "eager",
                      layers: tuple[int, ...] | None = None) -> PreTrainedModel:
    """A twin of `model` (its config and weights; eager attention by default, as `eager_twin`) with each attention's
    output projection computed as TransformerLens computes it with use_attn_result: each head's z_h W_O[h] (an
    einsum), summed over the heads, plus W_O's bias. The reference for a hooked forward that reads attn.hook_result
    (whose output is the sum of the values read): with the pattern read too under eager attention, else "sdpa";
    `layers`: only those layers' (default: every layer's)."""
    twin = eager_twin(model, attn_implementation)
    heads = twin.config.num_attention_heads
    found = 0  # the decoder layers met so far (modules() walks them in order)
    for layer in twin.base_model.modules():
        attn = next((getattr(layer, n) for n in ATTENTION_NAMES if isinstance(getattr(layer, n, None),
                                                                             torch.nn.Module)), None)
        if attn is None or not any(hasattr(attn, n) for n in OUTPUT_NAMES):
            continue
        found += 1
        if layers is not None and found - 1 not in layers:
            continue
        o = next(getattr(attn, n) for n in OUTPUT_NAMES if hasattr(attn, n))

        def summed(z, o=o):  # W_O read at each call, so the twin can be moved to another device
            w = o.weight if type(o).__name__ == "Conv1D" else o.weight.T  # [H * D, d]
            per_head = torch.einsum("bthk,hkd->bthd", z.unflatten(-1, (heads, -1)), w.unflatten(0, (heads, -1)))
            return per_head.sum(-2) + (o.bias if o.bias is not None else 0)

        o.forward = summed
    return twin


def token_batch(batch: int, seq_len: int, seed: int = 0, low: int = 3) -> torch.Tensor:
    """Random token ids [batch, seq_len] in [low, VOCAB) (ids below `low` are pad/bos/eos)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, VOCAB, (batch, seq_len), generator=g)


@torch.no_grad()
def randomize_norm_gains(model: PreTrainedModel, spread: float = 0.3, seed: int = 1) -> PreTrainedModel:
    """Give every residual-stream RMSNorm (not the q/k norms, which `_rescale_qk` sets) a random gain around 1 (and
    every LayerNorm a random bias around 0 too), so that a value before a norm's gain and after it differ (a fresh
    model's gains are all exactly 1). Returns the model."""
    g = torch.Generator().manual_seed(seed)
    for name, module in model.named_modules():
        if type(module).__name__.endswith("RMSNorm") and not name.endswith(("q_norm", "k_norm")):
            gain = 1 + spread * torch.randn(module.weight.shape, generator=g)
            gemma_style = "Gemma" in type(module).__name__  # output * (1 + weight)
            module.weight.copy_(gain - 1 if gemma_style else gain)
        elif isinstance(module, torch.nn.LayerNorm):  # GPT-2: a gain and a bias
            module.weight.copy_(1 + spread * torch.randn(module.weight.shape, generator=g))
            if module.bias is not None:  # (MPT's have none)
                module.bias.copy_(spread * torch.randn(module.bias.shape, generator=g))
    return model
