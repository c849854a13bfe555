"""TransformerLens 3.9's hook points on the tiny random models of families poslens added after Llama (run once by
hand; the output is stored and read by tests/test_family_tl.py).

For each family: the tiny model of tests/tiny_models.py (same seed, norm gains randomized as the hook tests do) is
built here from its config, its weights converted by TransformerLens's own converter for the architecture into a
`HookedTransformer` whose config is the one TransformerLens's `convert_hf_model_config` writes for the family's
checkpoints, sizes taken from the tiny config (TransformerLens reads configs of named hub models only, and nothing is
downloaded). No weight processing (`from_pretrained_no_processing`): norms not folded. `use_attn_result` and
`use_hook_mlp_in` on, so every point TransformerLens has fires. Stored per point: its shape, the float64 sum and
the largest of |x| over finite entries and x at five fixed places; and a checksum of the weights, so the test knows
it has the same model. TransformerLens is not a poslens dependency: install it in a venv of its own, then

    /tmp/tlvenv/bin/python tests/reference/make_tl_family_reference.py --out tests/reference/tl39_families.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib.metadata import version
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from tiny_models import build, randomize_norm_gains, token_batch  # noqa: E402

BATCH, SEQ, SEED = 2, 12, 11  # the token ids: token_batch(BATCH, SEQ, seed=SEED)


def summary(x: torch.Tensor) -> dict:
    """Shape, float64 sum and largest of |x| over its finite entries, and x at five fixed places of the flattened
    order (-inf as the string "-inf")."""
    flat = x.detach().double().reshape(-1)
    at = [0, flat.numel() // 3, flat.numel() // 2, 2 * flat.numel() // 3, flat.numel() - 1]
    finite = torch.isfinite(flat)
    return {"shape": list(x.shape), "abs_sum": float(flat[finite].abs().sum()),
            "abs_max": float(flat[finite].abs().max()), "at": at,
            "values": [float(flat[i]) if torch.isfinite(flat[i]) else str(float(flat[i])) for i in at]}


def weight_checksum(model) -> float:
    """The float64 sum of |w| over every parameter of the Hugging Face model."""
    return float(sum(p.detach().double().abs().sum() for p in model.parameters()))


def olmo2_config(hf):
    """TransformerLens's OLMo-2 config (convert_hf_model_config's allenai/OLMo-2 entries) at the tiny sizes."""
    from transformer_lens.config import HookedTransformerConfig

    c = hf.config
    return HookedTransformerConfig(
        d_model=c.hidden_size, d_head=c.hidden_size // c.num_attention_heads, n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size, n_layers=c.num_hidden_layers, n_ctx=c.max_position_embeddings, eps=c.rms_norm_eps,
        d_vocab=c.vocab_size, act_fn="silu", normalization_type="RMS", rotary_base=c.rope_parameters["rope_theta"],
        rotary_dim=c.hidden_size // c.num_attention_heads, attn_types=["global"] * c.num_hidden_layers,
        positional_embedding_type="rotary", gated_mlp=True, original_architecture="Olmo2ForCausalLM",
        final_rms=True, dtype=torch.float32, device="cpu")


def olmo_config(hf):
    """TransformerLens's OLMo (1) config (convert_hf_model_config's allenai/OLMo-1B-hf and OLMo-7B-hf entries:
    LayerNorm, silu, gated MLP, rotary, eps 1e-5, clip_qkv from the config) at the tiny sizes."""
    from transformer_lens.config import HookedTransformerConfig

    c = hf.config
    return HookedTransformerConfig(
        d_model=c.hidden_size, d_head=c.hidden_size // c.num_attention_heads, n_heads=c.num_attention_heads,
        d_mlp=c.intermediate_size, n_layers=c.num_hidden_layers, n_ctx=c.max_position_embeddings, eps=1e-5,
        d_vocab=c.vocab_size, act_fn="silu", normalization_type="LN", rotary_base=c.rope_parameters["rope_theta"],
        attn_types=["global"] * c.num_hidden_layers, positional_embedding_type="rotary", gated_mlp=True,
        clip_qkv=c.clip_qkv, original_architecture="OlmoForCausalLM", dtype=torch.float32, device="cpu")


def gpt2_config(hf):
    """TransformerLens's GPT-2 config (convert_hf_model_config's GPT2LMHeadModel branch; n_ctx: the table's rows)."""
    from transformer_lens.config import HookedTransformerConfig

    c = hf.config
    return HookedTransformerConfig(
        d_model=c.n_embd, d_head=c.n_embd // c.n_head, n_heads=c.n_head, d_mlp=c.n_embd * 4, n_layers=c.n_layer,
        n_ctx=c.n_positions, eps=c.layer_norm_epsilon, d_vocab=c.vocab_size, act_fn=c.activation_function,
        use_attn_scale=c.scale_attn_weights, use_local_attn=False,
        scale_attn_by_inverse_layer_idx=c.scale_attn_by_inverse_layer_idx, normalization_type="LN",
        original_architecture="GPT2LMHeadModel", dtype=torch.float32, device="cpu")


FAMILIES = {"olmo2": ("convert_olmo2_weights", olmo2_config), "gpt2": ("convert_gpt2_weights", gpt2_config),
            "olmo": ("convert_olmo_weights", olmo_config)}


def reference(family: str, table: dict | None = None) -> dict:
    from transformer_lens import HookedTransformer
    from transformer_lens.pretrained import weight_conversions

    hf = randomize_norm_gains(build(family))
    converter, make_config = (table or FAMILIES)[family]  # table: another script's families (same method)
    cfg = make_config(hf)
    tl = HookedTransformer(cfg)
    tl.load_state_dict(getattr(weight_conversions, converter)(hf, cfg), strict=False)
    tl.set_use_attn_result(True)
    tl.set_use_hook_mlp_in(True)
    tl.eval()
    ids = token_batch(BATCH, SEQ, seed=SEED)
    with torch.no_grad():
        logits, cache = tl.run_with_cache(ids)
        hf_logits = hf(input_ids=ids).logits
    return {"weights_abs_sum": weight_checksum(hf), "ids": ids.tolist(),
            "logits": summary(logits), "max_logit_deviation_from_hf": float((logits - hf_logits).abs().max()),
            "points": {name: summary(x) for name, x in cache.items()}}


def main(table: dict | None = None) -> None:
    """Write the reference of `table`'s families (another script's, same method), else this script's FAMILIES; the
    JSON's "script" is the script that ran (this one or one that imports it)."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = {"transformer_lens": version("transformer_lens"), "transformers": version("transformers"),
           "torch": torch.__version__, "python": platform.python_version(),
           "script": Path(sys.argv[0]).resolve().relative_to(ROOT).as_posix(),
           "families": {f: reference(f, table) for f in table or FAMILIES}}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for f, r in out["families"].items():
        print(f"{f}: {len(r['points'])} points; TransformerLens's logits within "
              f"{r['max_logit_deviation_from_hf']:.2e} of Hugging Face's")


if __name__ == "__main__":
    main()
