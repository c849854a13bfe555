"""Write a random model of a real model's shape as a Hugging Face model directory (run by hand, for benchmarks).

The shapes are benchmarks/capture.py's (SmolLM2-135M, Llama-3.1-8B; q/k rescaled so first-layer scores have std ~3,
as a trained model's), built on --device in --dtype and saved with `save_pretrained`; the tokenizer files of
--tokenizer (a model directory: SmolLM2-135M's converted one in the poslens cache, say) are copied beside them and
the config's BOS/EOS/pad ids set to that tokenizer's, so `poslens leakage DIR` / `poslens length DIR` read it as any
checkpoint. Timings on such a model are timings of the shape, not of the trained model's numbers.

    python3 benchmarks/random_model.py --shape llama-3.1-8b --device cuda --dtype bfloat16 \\
        --tokenizer ~/.cache/poslens/models/smollm2-135m --out /tmp/llama8b-random
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from capture import DTYPES, SHAPES  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--tokenizer", required=True, help="a model directory whose tokenizer files are copied")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out, source = Path(args.out), Path(args.tokenizer).expanduser()
    if out.exists():
        sys.exit(f"{out} exists: choose a new --out")
    ids = json.loads((source / "config.json").read_text())
    model = SHAPES[args.shape](DTYPES[args.dtype], args.device)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, key, ids.get(key))
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    n = sum(p.numel() for p in model.parameters())
    print(f"{out}: random {args.shape} ({n / 1e9:.2f} B parameters, {args.dtype})")


if __name__ == "__main__":
    main()
