"""Reference numbers from TransformerLens 3.9 for tests/test_tl_example.py (run once by hand; the output is stored).

Runs the worked example of docs/hooks.md ("Coming from TransformerLens") with TransformerLens 3.9's HookedTransformer
in place of HookedModel: the example's code unchanged but for its model-loading line, on the same weights (the
embedded SmolLM2-135M that poslens loads, converted by TransformerLens's Llama converter with from_pretrained's
default processing: norms folded, unembedding centred). Stores what it prints, its results at full precision
(tl_example.example_numbers), TransformerLens's own `utils.get_act_name` of every shortcut the tests use, and its
model surface on the unprocessed model (`from_pretrained_no_processing`'s weights: cfg, tokenization, the loss, a
summary of every weight). TransformerLens is not a poslens dependency: install it in a venv of its own, CPU torch
first (see benchmarks/hooks_vs_transformerlens.py), then

    PYTHONPATH=src:benchmarks /tmp/tlvenv/bin/python tests/reference/make_tl_reference.py \\
        --out tests/reference/tl39_worked_example.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from tl_example import example_numbers, run_example  # noqa: E402

# (name, layer, layer_type) shortcuts: TransformerLens's documented forms and every point kind
SHORTCUTS = [("embed", None, None), ("pos_embed", None, None), ("resid_pre", 10, None), ("resid_mid", 2, "block"),
             ("resid_post", 3, None), ("attn_out", 3, None), ("mlp_out", 1, None), ("mlp_in", 0, None),
             ("attn_in", 0, None), ("q_input", 2, None), ("k_input", 2, None), ("v_input", 2, None),
             ("q", 1, None), ("k", 1, None), ("v", 1, None), ("z", 0, "a"), ("rot_q", 1, None), ("rot_k", 1, None),
             ("result", 1, None), ("pattern", 0, None), ("attn", 0, None), ("attn_scores", 2, None),
             ("attn_logits", 2, None), ("key", 3, None), ("query", 3, None), ("value", 3, None),
             ("pre", 5, None), ("pre_linear", 5, None), ("post", 5, None), ("mlp_pre", 1, None),
             ("mlp_post", 1, None), ("scale", 4, "ln1"), ("normalized", 2, "ln2"), ("scale", None, None),
             ("normalized", None, None), ("k6", None, None), ("scale4ln1", None, None), ("pre5", None, None),
             ("resid_pre", None, None), ("blocks.0.hook_resid_post", None, None)]


CFG_FIELDS = ["n_layers", "d_model", "n_heads", "d_head", "d_mlp", "n_ctx", "d_vocab", "d_vocab_out",
              "n_key_value_heads", "act_fn", "eps", "positional_embedding_type", "rotary_dim", "rotary_base",
              "default_prepend_bos", "tokenizer_prepends_bos", "gated_mlp", "final_rms"]
WEIGHTS = ["W_E", "W_Q", "W_K", "W_V", "W_O", "b_Q", "b_K", "b_V", "b_O", "W_gate", "W_in", "W_out", "b_in", "b_out",
           "W_U", "b_U"]
TEXTS = ["The causal mask encodes position.", "When Mary and John went to the store, John gave a drink to"]


def weight_summary(w) -> dict:
    """A weight's shape, the float64 sum of its absolute values and its entries at a few fixed places (first, last,
    and three in between along the flattened order)."""
    flat = w.detach().double().reshape(-1)
    at = [0, flat.numel() // 3, flat.numel() // 2, 2 * flat.numel() // 3, flat.numel() - 1]
    return {"shape": list(w.shape), "abs_sum": float(flat.abs().sum()), "at": at,
            "values": [float(flat[i]) for i in at]}


def surface(tl) -> dict:
    """TransformerLens's model surface on the unprocessed model: cfg, tokenization, the loss, the weights."""
    import torch

    tokens = tl.to_tokens(TEXTS[1])
    with torch.no_grad():
        loss = float(tl(tokens, return_type="loss"))
    return {"cfg": {f: getattr(tl.cfg, f) for f in CFG_FIELDS},
            "to_tokens": [tl.to_tokens(t)[0].tolist() for t in TEXTS],
            "to_tokens_no_bos": [tl.to_tokens(t, prepend_bos=False)[0].tolist() for t in TEXTS],
            "to_tokens_batch": tl.to_tokens(TEXTS).tolist(),
            "to_str_tokens": [tl.to_str_tokens(t) for t in TEXTS],
            "to_string": tl.to_string(tl.to_tokens(TEXTS[0])[0]),
            "loss": loss, "weights": {w: weight_summary(getattr(tl, w)) for w in WEIGHTS}}


def provenance(script: str) -> dict:
    """What made a reference file: the script, the library versions, the machine, the model and its processing."""
    import torch

    return {"made_by": script, "transformer_lens": version("transformer-lens"), "torch": torch.__version__,
            "transformers": version("transformers"), "machine": platform.machine(),
            "model": "smollm2-135m (the embedded GGUF as poslens loads it), float32, CPU; TransformerLens processing: "
                     "fold_ln, center_writing_weights, center_unembed, fold_value_biases (from_pretrained's defaults)"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from hooks_vs_transformerlens import transformer_lens_model
    from transformer_lens import utils

    from poslens.engine.models import load_model

    model, tok = load_model("smollm2-135m")
    tl = transformer_lens_model(model, tok, processed=True)
    printed, namespace = run_example(loading="model = TL_MODEL", TL_MODEL=tl)
    record = {
        **provenance("tests/reference/make_tl_reference.py"),
        "printed": printed,
        "numbers": example_numbers(namespace),
        "get_act_name": [[list(s), utils.get_act_name(*s)] for s in SHORTCUTS],
        "surface": surface(transformer_lens_model(model, tok)),
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print("\n".join(printed))


if __name__ == "__main__":
    main()
