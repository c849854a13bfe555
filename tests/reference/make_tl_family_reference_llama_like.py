"""TransformerLens 3.9's hook points on the tiny random models of the Llama-like families whose TransformerLens config
is read from the model's own config: Qwen2, Qwen3 and Mistral (run once by hand; the output is stored and read by
tests/test_family_tl.py).

The same procedure as tests/reference/make_tl_family_reference.py (whose functions this script imports), except that
the HookedTransformer's config is not written out here: the tiny model's config.json is saved to a directory and
TransformerLens's own `convert_hf_model_config` reads it (its Qwen2ForCausalLM, Qwen3ForCausalLM and
MistralForCausalLM branches, the ones it runs for those checkpoints). Weights by TransformerLens's converters; no
weight processing; `use_attn_result` and `use_hook_mlp_in` on; 20 tokens (the tiny Mistral's window is 12 keys).
Install TransformerLens in a venv of its own, then

    /tmp/tlvenv/bin/python tests/reference/make_tl_family_reference_llama_like.py \\
        --out tests/reference/tl39_families_llama_like.json
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_tl_family_reference as base  # noqa: E402


def read_config(hf):
    """TransformerLens's config for `hf`, from its convert_hf_model_config on the saved config.json (a directory
    whose name holds no family name TransformerLens routes by)."""
    from transformer_lens.config import HookedTransformerConfig
    from transformer_lens.loading_from_pretrained import convert_hf_model_config

    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp) / "tiny"
        hf.config.architectures = [type(hf).__name__]  # as a checkpoint's config.json names it
        hf.config.save_pretrained(where)
        fields = convert_hf_model_config(str(where))
    for key in ("trust_remote_code", "tokenizer_name"):  # no tokenizer: the tiny model has none
        fields.pop(key, None)
    return HookedTransformerConfig(**fields, dtype=torch.float32, device="cpu")


FAMILIES = {"qwen2": ("convert_qwen2_weights", read_config), "qwen3": ("convert_qwen3_weights", read_config),
            "mistral": ("convert_mistral_weights", read_config)}


if __name__ == "__main__":
    base.SEQ = 20  # past the tiny Mistral's window of 12 keys, so that the window hides some
    base.main(FAMILIES)
