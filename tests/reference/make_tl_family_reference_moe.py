"""TransformerLens 3.9's hook points on the tiny random mixtures of experts TransformerLens has, Mixtral and OLMoE (run
once by hand; the output is stored and read by tests/test_moe.py).

The same procedure as tests/reference/make_tl_family_reference_llama_like.py: the tiny model's config.json read by
TransformerLens's own `convert_hf_model_config` (its MixtralForCausalLM and OlmoeForCausalLM branches), weights by its
converters, no weight processing, `use_attn_result` and `use_hook_mlp_in` on. Stored per point as the other
references store it (shape, float64 sum and largest of |x|, five values); the router and expert points too
(hook_expert_weights [B*T, E], hook_expert_indices [B*T, k], experts.{e}.hook_gate/pre/post [n_e, M]). Install
TransformerLens in a venv of its own, then

    /tmp/tlvenv/bin/python tests/reference/make_tl_family_reference_moe.py --out tests/reference/tl39_families_moe.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_tl_family_reference as base  # noqa: E402
import torch  # noqa: E402


def read_config(hf):
    """TransformerLens's config for `hf` from its convert_hf_model_config on the saved config.json, in float32 (its
    Mixtral branch writes bfloat16, the released checkpoint's dtype; the tiny model is float32)."""
    import tempfile

    from transformer_lens.config import HookedTransformerConfig
    from transformer_lens.loading_from_pretrained import convert_hf_model_config

    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "tiny"
        hf.config.architectures = [type(hf).__name__]
        hf.config.save_pretrained(where)
        fields = convert_hf_model_config(str(where))
    for key in ("trust_remote_code", "tokenizer_name", "dtype"):
        fields.pop(key, None)
    return HookedTransformerConfig(**fields, dtype=torch.float32, device="cpu")


FAMILIES = {"mixtral": ("convert_mixtral_weights", read_config), "olmoe": ("convert_olmoe_weights", read_config)}


if __name__ == "__main__":
    base.main(FAMILIES)
