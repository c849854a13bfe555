"""Reference numbers from TransformerLens 3.9 for tests/test_tl_factored.py (run once by hand; the output is stored).

Runs tests/tl_demo.py's `weights_demo` (the Main Demo's FactoredMatrix section, model.OV / model.QK, the full OV
circuit, model.blocks[l]'s weights and hook points: the same code poslens runs, only the model and the FactoredMatrix
class differ) with TransformerLens 3.9's HookedTransformer on the embedded SmolLM2-135M's weights without processing
(TransformerLens's `from_pretrained_no_processing`: the norms' gains stay in the norms, as poslens keeps them, so
W_V, W_O, W_E, W_U are the same tensors on both). TransformerLens is not a poslens dependency: install it in a venv of
its own (see benchmarks/hooks_vs_transformerlens.py), then

    PYTHONPATH=src:benchmarks:tests /tmp/tlvenv/bin/python tests/reference/make_tl_weights_reference.py \\
        --out tests/reference/tl39_weights.json
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
    args = p.parse_args()

    from hooks_vs_transformerlens import transformer_lens_model

    warnings.simplefilter("ignore", DeprecationWarning)
    from transformer_lens import FactoredMatrix

    from poslens.engine.models import load_model

    model, tok = load_model("smollm2-135m")
    tl = transformer_lens_model(model, tok, processed=False)
    record = {**provenance("tests/reference/make_tl_weights_reference.py"),
              "model": "smollm2-135m (the embedded GGUF as poslens loads it), float32, CPU; TransformerLens "
                       "processing: none (from_pretrained_no_processing)",
              "weights_demo": tl_demo.weights_demo(tl, FactoredMatrix)}
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
