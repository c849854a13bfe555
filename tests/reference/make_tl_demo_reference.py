"""Reference numbers from TransformerLens 3.9 for tests/test_tl_demo.py (run once by hand; the output is stored).

Runs the idioms of TransformerLens's Main Demo and Exploratory Analysis Demo notebooks (tests/tl_demo.py: the same
code poslens runs, only the model differs) and its per-head attention inputs (use_split_qkv_input) with TransformerLens
3.9's HookedTransformer on the same weights: the embedded SmolLM2-135M that poslens loads, converted by
TransformerLens's Llama converter with from_pretrained's default processing (norms folded, unembedding centred), as
tests/reference/make_tl_reference.py does. Also records TransformerLens's refusal of hook_attn_in on this
grouped-query model. TransformerLens is not a poslens dependency: install it in a venv of its own (see
benchmarks/hooks_vs_transformerlens.py), then

    PYTHONPATH=src:benchmarks:tests /tmp/tlvenv/bin/python tests/reference/make_tl_demo_reference.py \\
        --out tests/reference/tl39_demo_idioms.json

With `--weights` it runs tests/tl_demo.py's `weights_demo` instead (for tests/test_tl_factored.py: the Main Demo's
FactoredMatrix section, model.OV / model.QK, the full OV circuit, model.blocks[l]'s weights and hook points; only the
model and the FactoredMatrix class differ) on the same weights without processing (TransformerLens's
`from_pretrained_no_processing`: the norms keep their gains, as poslens's do, so W_V, W_O, W_E, W_U are the same
tensors on both), into tests/reference/tl39_weights.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

import tl_demo  # noqa: E402
from make_tl_reference import provenance  # noqa: E402  (this folder is the script's own, first on sys.path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--weights", action="store_true", help="the weight idioms on unprocessed weights")
    args = p.parse_args()

    from hooks_vs_transformerlens import transformer_lens_model

    warnings.simplefilter("ignore", DeprecationWarning)
    from transformer_lens import utils

    from poslens.engine.models import load_model

    model, tok = load_model("smollm2-135m")
    if args.weights:
        from transformer_lens import FactoredMatrix

        tl = transformer_lens_model(model, tok, processed=False)
        record = {**provenance("tests/reference/make_tl_demo_reference.py --weights"),
                  "model": "smollm2-135m (the embedded GGUF as poslens loads it), float32, CPU; TransformerLens "
                           "processing: none (from_pretrained_no_processing)",
                  "weights_demo": tl_demo.weights_demo(tl, FactoredMatrix)}
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
        return
    tl = transformer_lens_model(model, tok, processed=True)
    try:
        tl.set_use_attn_in(True)
        attn_in = "accepted"
    except AssertionError as e:
        attn_in = str(e)
    record = {
        **provenance("tests/reference/make_tl_demo_reference.py"),
        "set_use_attn_in": attn_in,
        "split_inputs": tl_demo.split_inputs(tl, utils),
        "main_demo": tl_demo.main_demo(tl, utils),
        "exploratory_demo": tl_demo.exploratory_demo(tl, utils),
    }
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
