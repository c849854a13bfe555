"""TransformerLens 3.9's hook points on the tiny random models of the learned-table and ALiBi families (OPT, BLOOM):
the companion of make_tl_family_reference.py (same method, same summaries, its functions imported), stored apart so
that each script's families live in one file; read by tests/test_family_tl.py.

    /tmp/tlvenv/bin/python tests/reference/make_tl_family_reference_alibi.py \
        --out tests/reference/tl39_families_alibi.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_tl_family_reference as base  # noqa: E402


def opt_config(hf):
    """TransformerLens's OPT config (convert_hf_model_config's OPTForCausalLM branch; n_ctx: the table's rows past
    its offset of 2)."""
    from transformer_lens.config import HookedTransformerConfig

    c = hf.config
    return HookedTransformerConfig(
        d_model=c.hidden_size, d_head=c.hidden_size // c.num_attention_heads, n_heads=c.num_attention_heads,
        d_mlp=c.ffn_dim, n_layers=c.num_hidden_layers, n_ctx=c.max_position_embeddings, eps=1e-5,
        d_vocab=c.vocab_size, act_fn=c.activation_function, use_attn_scale=True, use_local_attn=False,
        scale_attn_by_inverse_layer_idx=False, normalization_type="LN", original_architecture="OPTForCausalLM",
        dtype=torch.float32, device="cpu")


def bloom_config(hf):
    """TransformerLens's BLOOM config (convert_hf_model_config's BloomForCausalLM branch: ALiBi, a LayerNorm after the
    embedding, gelu_fast, n_ctx 2048) at the tiny sizes."""
    from transformer_lens.config import HookedTransformerConfig

    c = hf.config
    return HookedTransformerConfig(
        d_model=c.hidden_size, d_head=c.hidden_size // c.n_head, n_heads=c.n_head, d_mlp=c.hidden_size * 4,
        n_layers=c.n_layer, n_ctx=2048, d_vocab=c.vocab_size, act_fn="gelu_fast", eps=c.layer_norm_epsilon,
        normalization_type="LN", post_embedding_ln=True, positional_embedding_type="alibi",
        default_prepend_bos=False, original_architecture="BloomForCausalLM", dtype=torch.float32, device="cpu")


FAMILIES = {"opt": ("convert_opt_weights", opt_config), "bloom": ("convert_bloom_weights", bloom_config)}


if __name__ == "__main__":
    base.main(FAMILIES)
