"""TransformerLens 3.9's per-head attention inputs (`use_split_qkv_input`: hook_q_input, hook_k_input, hook_v_input)
written, on the tiny models of the families whose q, k and v come from one fused projection or after an embedding
LayerNorm: GPT-NeoX, BLOOM (per-head fused query_key_value), OPT and GPT-Neo (read by tests/test_tl_inputs_fused.py).

The models and TransformerLens configs of make_tl_family_reference_rotary.py, make_tl_family_reference_alibi.py and
make_tl_family_reference_gpt_neo.py (their functions imported; same seed, same token ids), `use_split_qkv_input` on.
For each of the three points, one run that adds a fixed vector (`shift(part)`) to one head's copy at layer WRITE_LAYER
(returned as a new tensor): stored, the logits' summary and the written part's projection (`attn.hook_q`, `hook_k` or
`hook_v` of that layer), and the point's shape unwritten. Install TransformerLens in a venv of its own, then

    /tmp/tlvenv/bin/python tests/reference/make_tl_family_reference_inputs.py \\
        --out tests/reference/tl39_families_inputs.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from importlib.metadata import version
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import make_tl_family_reference as base  # noqa: E402
import make_tl_family_reference_alibi as alibi  # noqa: E402
import make_tl_family_reference_gpt_neo as gpt_neo  # noqa: E402
import make_tl_family_reference_rotary as rotary  # noqa: E402

WRITE_LAYER = 1
HEAD = {"q": 2, "k": 1, "v": 0}  # the head whose copy each write edits
FAMILIES = {"gpt_neox": rotary.FAMILIES["gpt_neox"], "bloom": alibi.FAMILIES["bloom"], "opt": alibi.FAMILIES["opt"],
            "gpt_neo": gpt_neo.FAMILIES["gpt_neo"]}


def shift(part: str, width: int) -> torch.Tensor:
    """The vector added to head HEAD[part]'s copy of hook_{part}_input (a fixed draw per part)."""
    return torch.randn(width, generator=torch.Generator().manual_seed("qkv".index(part) + 20))


def write(part: str, width: int):
    """fn(x, hook) -> x with the shift added to head HEAD[part]'s copy, as a new tensor (TransformerLens's hook form;
    the test writes the same with poslens's)."""
    vector = shift(part, width)

    def fn(x, hook):
        y = x.clone()
        y[:, :, HEAD[part]] += vector.to(y.dtype)
        return y

    return fn


def reference(family: str) -> dict:
    from transformer_lens import HookedTransformer
    from transformer_lens.pretrained import weight_conversions

    hf = base.randomize_norm_gains(base.build(family))
    converter, make_config = FAMILIES[family]
    cfg = make_config(hf)
    tl = HookedTransformer(cfg)
    tl.load_state_dict(getattr(weight_conversions, converter)(hf, cfg), strict=False)
    tl.set_use_split_qkv_input(True)
    tl.eval()
    ids = base.token_batch(base.BATCH, base.SEQ, seed=base.SEED)
    out = {"weights_abs_sum": base.weight_checksum(hf), "ids": ids.tolist(), "write_layer": WRITE_LAYER,
           "heads": HEAD, "writes": {}}
    with torch.no_grad():
        logits, cache = tl.run_with_cache(ids)
        out["logits"] = base.summary(logits)
        out["shapes"] = {p: list(cache[f"blocks.{WRITE_LAYER}.hook_{p}_input"].shape) for p in "qkv"}
        for part in "qkv":
            seen = {}
            point = f"blocks.{WRITE_LAYER}.attn.hook_{part}"
            written = tl.run_with_hooks(ids, fwd_hooks=[
                (f"blocks.{WRITE_LAYER}.hook_{part}_input", write(part, cfg.d_model)),
                (point, lambda x, hook, seen=seen: seen.setdefault("x", x.clone()))])
            out["writes"][part] = {"logits": base.summary(written), point: base.summary(seen["x"]),
                                   "max_logit_change": float((written - logits).abs().max())}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    out = {"transformer_lens": version("transformer_lens"), "transformers": version("transformers"),
           "torch": torch.__version__, "python": platform.python_version(),
           "script": Path(sys.argv[0]).resolve().relative_to(base.ROOT).as_posix(),
           "families": {f: reference(f) for f in FAMILIES}}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for f, r in out["families"].items():
        print(f"{f}: " + ", ".join(f"{p}_input moves the logits by {w['max_logit_change']:.3g}"
                                   for p, w in r["writes"].items()))


if __name__ == "__main__":
    main()
