"""TransformerLens 3.9's hook points on the tiny random Gemma (1), Gemma-2 and Gemma-3 models (run once by hand; the
output is stored and read by tests/test_family_tl.py).

The same procedure as tests/reference/make_tl_family_reference.py (whose functions this script imports): the tiny
model of tests/tiny_models.py with randomized norm gains, its weights converted by TransformerLens's own converter
(`convert_gemma_weights`: the embedding scaled by sqrt(d_model), 1 added to every norm gain) into a
`HookedTransformer` whose config is the one TransformerLens's `convert_hf_model_config` writes for google/gemma-2b,
google/gemma-2-2b and google/gemma-3-270m (RMS norms, rotary on the whole head, a gated MLP; Gemma-2 and -3: norms
after the sublayers, local and global layers with a window; Gemma-2: the score and logit softcaps; Gemma-3: q/k norms
and a local RoPE base), at the tiny sizes (`attn_scale` from query_pre_attn_scalar, as the gemma-2-27b entry sets
it), with one change for Gemma (1): the activation is `gelu_pytorch_tanh`, which Hugging Face's Gemma runs (it reads a
config's "gelu" as the tanh form), where the gemma-2b entry says "gelu" (exact; on this model that alone moves
mlp.hook_post by 2.4e-5 of its largest value); no weight processing; `use_attn_result` and `use_hook_mlp_in` on; 20
tokens (the tiny models' windows are 12 keys). Install TransformerLens in a venv of its own, then

    /tmp/tlvenv/bin/python tests/reference/make_tl_family_reference_gemma.py \\
        --out tests/reference/tl39_families_gemma.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_tl_family_reference as base  # noqa: E402


def gemma_config(hf):
    """TransformerLens's google/gemma-2b entry at the tiny sizes."""
    from transformer_lens.config import HookedTransformerConfig

    c = hf.config
    return HookedTransformerConfig(
        d_model=c.hidden_size, d_head=c.head_dim, n_heads=c.num_attention_heads, d_mlp=c.intermediate_size,
        n_layers=c.num_hidden_layers, n_ctx=c.max_position_embeddings, eps=c.rms_norm_eps, d_vocab=c.vocab_size,
        act_fn="gelu_pytorch_tanh", normalization_type="RMS", rotary_base=c.rope_parameters["rope_theta"],
        rotary_dim=c.head_dim,
        positional_embedding_type="rotary", use_attn_scale=True, n_key_value_heads=c.num_key_value_heads,
        gated_mlp=True, final_rms=True, original_architecture="GemmaForCausalLM", dtype=torch.float32, device="cpu")


def _windowed(hf, **fields):
    """The Gemma-2 / Gemma-3 fields: sandwich norms, a local ("sliding_attention") or global layer each, the window,
    the scale sqrt(query_pre_attn_scalar)."""
    from transformer_lens.config import HookedTransformerConfig

    c = hf.config
    kinds = ["local" if t == "sliding_attention" else "global" for t in c.layer_types]
    return HookedTransformerConfig(
        d_model=c.hidden_size, d_head=c.head_dim, n_heads=c.num_attention_heads, d_mlp=c.intermediate_size,
        n_layers=c.num_hidden_layers, n_ctx=c.max_position_embeddings, eps=c.rms_norm_eps, d_vocab=c.vocab_size,
        act_fn="gelu_pytorch_tanh", normalization_type="RMS", positional_embedding_type="rotary", use_attn_scale=True,
        attn_scale=c.query_pre_attn_scalar**0.5, n_key_value_heads=c.num_key_value_heads, window_size=c.sliding_window,
        use_local_attn=True, attn_types=kinds, gated_mlp=True, final_rms=True,
        use_normalization_before_and_after=True, dtype=torch.float32, device="cpu", **fields)


def gemma2_config(hf):
    """TransformerLens's google/gemma-2-2b entry at the tiny sizes: softcaps on the scores and the logits."""
    c = hf.config
    return _windowed(hf, rotary_base=c.rope_parameters["rope_theta"], attn_scores_soft_cap=c.attn_logit_softcapping,
                     output_logits_soft_cap=c.final_logit_softcapping, original_architecture="Gemma2ForCausalLM")


def gemma3_config(hf):
    """TransformerLens's google/gemma-3-270m entry at the tiny sizes: q/k norms, the global and the local RoPE base."""
    p = hf.config.rope_parameters
    return _windowed(hf, rotary_base=p["full_attention"]["rope_theta"],
                     rotary_base_local=p["sliding_attention"]["rope_theta"], use_qk_norm=True,
                     original_architecture="Gemma3ForCausalLM")


FAMILIES = {"gemma": ("convert_gemma_weights", gemma_config), "gemma2": ("convert_gemma_weights", gemma2_config),
            "gemma3": ("convert_gemma_weights", gemma3_config)}


if __name__ == "__main__":
    base.SEQ = 20  # past the tiny Gemma-2's and Gemma-3's window of 12 keys, so that the window hides some
    base.main(FAMILIES)
