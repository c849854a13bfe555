"""TransformerLens 3.9's hook points on the tiny random models of the rotary-on-part-of-the-head families with a
parallel residual: GPT-NeoX (Pythia), GPT-J and Phi (run once by hand; the output is stored and read by
tests/test_family_tl_rotary.py).

The same procedure as tests/reference/make_tl_family_reference.py (whose functions this script imports): the tiny
model of tests/tiny_models.py with randomized LayerNorm gains and biases, its weights converted by TransformerLens's own
converter for the architecture into a `HookedTransformer` whose config is the one TransformerLens's
`convert_hf_model_config` writes for the family's checkpoints (its GPTNeoXForCausalLM, GPTJForCausalLM and
PhiForCausalLM branches), at the tiny sizes; no weight processing; `use_attn_result` and `use_hook_mlp_in` on. Install
TransformerLens in a venv of its own, then

    /tmp/tlvenv/bin/python tests/reference/make_tl_family_reference_rotary.py \\
        --out tests/reference/tl39_families_rotary.json
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_tl_family_reference as base  # noqa: E402


def _rotary(c, **fields):
    """The HookedTransformerConfig fields the three families share (LayerNorm, rotary, parallel attention and MLP)."""
    from transformer_lens.config import HookedTransformerConfig

    return HookedTransformerConfig(
        d_model=c.hidden_size, d_head=c.hidden_size // c.num_attention_heads, n_heads=c.num_attention_heads,
        n_layers=c.num_hidden_layers, d_vocab=c.vocab_size, use_attn_scale=True, normalization_type="LN",
        positional_embedding_type="rotary", dtype=torch.float32, device="cpu", **fields)


def gpt_neox_config(hf):
    """TransformerLens's GPTNeoXForCausalLM branch: rotary_dim = round(rotary_pct * d_head), halves rotated."""
    c = hf.config
    return _rotary(c, d_mlp=c.intermediate_size, n_ctx=c.max_position_embeddings, eps=c.layer_norm_eps,
                   act_fn=c.hidden_act, parallel_attn_mlp=c.use_parallel_residual, rotary_adjacent_pairs=False,
                   rotary_dim=round(c.rope_parameters["partial_rotary_factor"] * (c.hidden_size //
                                                                                 c.num_attention_heads)),
                   rotary_base=c.rope_parameters["rope_theta"], default_prepend_bos=False,
                   original_architecture="GPTNeoXForCausalLM")


def gptj_config(hf):
    """TransformerLens's GPTJForCausalLM branch: d_mlp 4 * d_model, eps 1e-5, rotary_dim, adjacent pairs rotated."""
    c = hf.config
    return _rotary(c, d_mlp=4 * c.n_embd, n_ctx=c.n_positions, eps=1e-5, act_fn=c.activation_function,
                   parallel_attn_mlp=True, rotary_dim=c.rotary_dim, rotary_adjacent_pairs=True,
                   original_architecture="GPTJForCausalLM")


def phi_config(hf):
    """TransformerLens's PhiForCausalLM branch: rotary_dim = round(partial_rotary_factor * d_head)."""
    c = hf.config
    return _rotary(c, d_mlp=c.intermediate_size, n_ctx=c.max_position_embeddings, eps=c.layer_norm_eps,
                   act_fn=c.hidden_act, parallel_attn_mlp=True, rotary_base=c.rope_parameters["rope_theta"],
                   rotary_dim=round(c.rope_parameters["partial_rotary_factor"] * (c.hidden_size //
                                                                                 c.num_attention_heads)),
                   default_prepend_bos=False, original_architecture="PhiForCausalLM")


FAMILIES = {"gpt_neox": ("convert_neox_weights", gpt_neox_config), "gptj": ("convert_gptj_weights", gptj_config),
            "phi": ("convert_phi_weights", phi_config)}


if __name__ == "__main__":
    base.main(FAMILIES)
