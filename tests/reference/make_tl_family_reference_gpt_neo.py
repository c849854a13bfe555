"""TransformerLens 3.9's hook points on the tiny random GPT-Neo (a learned position table, layers alternating global
and local attention, scores without the 1/sqrt(d_head) scaling; run once by hand; the output is stored and read by
tests/test_family_tl.py).

The procedure of tests/reference/make_tl_family_reference_llama_like.py (whose config reader this script imports):
TransformerLens's own `convert_hf_model_config` reads the tiny model's saved config.json (its GPTNeoForCausalLM
branch: attn_types from attention_layers, use_local_attn, window_size, use_attn_scale False), its
`convert_neo_weights` converts the weights; no weight processing; `use_attn_result` and `use_hook_mlp_in` on; 20
tokens, so that the local layer's window of 12 keys hides some. Install TransformerLens in a venv of its own, then

    /tmp/tlvenv/bin/python tests/reference/make_tl_family_reference_gpt_neo.py \\
        --out tests/reference/tl39_families_gpt_neo.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_tl_family_reference as base  # noqa: E402
from make_tl_family_reference_llama_like import read_config  # noqa: E402

FAMILIES = {"gpt_neo": ("convert_neo_weights", read_config)}


if __name__ == "__main__":
    base.SEQ = 20  # past the local layer's window of 12 keys
    base.main(FAMILIES)
