"""TransformerLens 3.9's hook points on the tiny random Gemma (1) model (run once by hand; the output is stored and read
by tests/test_family_tl_gemma.py).

The same procedure as tests/reference/make_tl_family_reference.py (whose functions this script imports): the tiny
model of tests/tiny_models.py with randomized norm gains, its weights converted by TransformerLens's own converter
(`convert_gemma_weights`: the embedding scaled by sqrt(d_model), 1 added to every norm gain) into a
`HookedTransformer` whose config is the one TransformerLens's `convert_hf_model_config` writes for google/gemma-2b
(RMS norms, rotary on the whole head, a gated MLP), at the tiny sizes, with one change: the activation is
`gelu_pytorch_tanh`, which Hugging Face's Gemma runs (it reads a config's "gelu" as the tanh form), where the entry says
"gelu" (exact; on this model that alone moves mlp.hook_post by 2.4e-5 of its largest value); no weight processing;
`use_attn_result` and `use_hook_mlp_in` on. Install TransformerLens in a venv of its own, then

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


FAMILIES = {"gemma": ("convert_gemma_weights", gemma_config)}


if __name__ == "__main__":
    base.main(FAMILIES)
