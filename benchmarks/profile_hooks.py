"""Profile: where the hook engine's reading cost goes, by operator, against a plain forward (run by hand).

Per model (the embedded SmolLM2-135M as `benchmarks/hooks_vs_transformerlens.py` reads it: a reader at every point
but the LM head's and TransformerLens's optional ones, no logits; and each family of `benchmarks/families.py`: every
point read, logits), `torch.profiler` records `--repeats` calls of each arm after a warm-up, on one thread:

* plain: `model(ids)` with SDPA and logits;
* read:  `HookedModel.run(ids, hooks=...)` with a reader (a hook that takes the value and keeps nothing) at the
         points above.

Printed per model: the self CPU milliseconds per call of each operator group in both arms and their difference
(what reading adds), and the Python time outside any operator (the hook dispatch: call wall time minus the
operators' self time). Groups: attention kernels (SDPA), score GEMMs and softmax (the [B, H, T, T] matmuls, softmax,
masking), projections (linear, addmm, mm), norms, copies (copy_, clone, cat, repeat, contiguous), elementwise, other.

    PYTHONPATH=src:tests .venv/bin/python benchmarks/profile_hooks.py --out benchmarks/results/cpu-hooks/profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))

from families import FAMILIES, model_of  # noqa: E402
from tiny_models import token_batch  # noqa: E402

from poslens.engine.hooks import OPTIONAL, HookedModel  # noqa: E402

GROUPS = {
    "attention kernel (SDPA)": ("scaled_dot_product", "flash_attention"),
    "scores and pattern (bmm, softmax, mask)": ("bmm", "baddbmm", "softmax", "masked_fill", "nan_to_num", "matmul",
                                                "tanh"),
    "projections (linear, addmm, mm)": ("linear", "addmm", "aten::mm", "einsum"),
    "norms": ("layer_norm", "rsqrt", "aten::pow", "aten::mean", "aten::sqrt", "aten::var"),
    "copies (copy_, clone, cat, repeat, contiguous)": ("copy_", "clone", "aten::cat", "repeat", "contiguous", "stack",
                                                       "aten::to", "_to_copy"),
    "elementwise (add, mul, div, gelu, silu)": ("aten::add", "aten::mul", "aten::div", "gelu", "silu", "aten::sub",
                                                "aten::neg", "relu", "aten::where", "aten::sum"),
}


def group_of(op: str) -> str:
    for group, keys in GROUPS.items():
        if any(k in op for k in keys):
            return group
    return "other"


def profiled(fn, repeats: int) -> dict:
    """Self CPU ms per call by operator and by group, wall ms per call, and the Python time outside operators."""
    fn()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        wall = (time.perf_counter() - start) / repeats * 1e3
    ops: dict[str, float] = {}
    for e in prof.key_averages():
        ops[e.key] = ops.get(e.key, 0.0) + e.self_cpu_time_total / 1e3 / repeats
    groups: dict[str, float] = {}
    for op, ms in ops.items():
        groups[group_of(op)] = groups.get(group_of(op), 0.0) + ms
    return {"wall_ms": wall, "ops_ms": ops, "groups_ms": groups, "outside_ops_ms": wall - sum(ops.values())}


def compare(label: str, plain, read, repeats: int) -> dict:
    with torch.no_grad():
        p, r = profiled(plain, repeats), profiled(read, repeats)
    print(f"\n{label}: plain {p['wall_ms']:.1f} ms, read {r['wall_ms']:.1f} ms per call "
          f"(profiled; ratio {r['wall_ms'] / p['wall_ms']:.3f})")
    print(f"  {'group':50s} {'plain':>8s} {'read':>8s} {'excess':>8s}")
    for g in [*GROUPS, "other"]:
        a, b = p["groups_ms"].get(g, 0.0), r["groups_ms"].get(g, 0.0)
        print(f"  {g:50s} {a:8.1f} {b:8.1f} {b - a:+8.1f}")
    a, b = p["outside_ops_ms"], r["outside_ops_ms"]
    print(f"  {'Python outside operators (hook dispatch)':50s} {a:8.1f} {b:8.1f} {b - a:+8.1f}")
    top = sorted(r["ops_ms"], key=lambda o: r["ops_ms"][o] - p["ops_ms"].get(o, 0.0), reverse=True)[:8]
    print("  largest excess by operator: " + ", ".join(
        f"{o} {r['ops_ms'][o] - p['ops_ms'].get(o, 0.0):+.1f}" for o in top))
    return {"plain": p, "read": r}


def smollm(args) -> dict:
    from poslens.engine.data import iter_documents, make_sequences
    from poslens.engine.models import load_model

    model, tok = load_model("smollm2-135m")
    ids, _ = make_sequences(tok, iter_documents(None), args.seq_len, args.batch, mode="first", bos="auto")
    hm = HookedModel(model)
    points = [n for n in hm.points if not n.startswith("unembed.") and n.split(".", 2)[-1] not in OPTIONAL]
    hooks = {n: (lambda x, ctx: None) for n in points}
    return compare("SmolLM2-135M, every point but the LM head's (no logits)",
                   lambda: model(input_ids=ids, use_cache=False).logits, lambda: hm.run(ids, hooks=hooks),
                   args.repeats)


def family(name: str, args) -> dict:
    model = model_of(name, args.hidden, args.layers)
    hm = HookedModel(model)
    ids = token_batch(args.batch, args.seq_len, seed=0)
    hooks = {p: (lambda x, ctx: None) for p in hm.points}
    return compare(f"{name}, every point (logits)", lambda: model(input_ids=ids, use_cache=False).logits,
                   lambda: hm.run(ids, hooks=hooks, logits=True).logits, args.repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["smollm2", *FAMILIES], choices=["smollm2", *FAMILIES])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    out = {"config": vars(args), "torch": torch.__version__, "models": {}}
    for m in args.models:
        out["models"][m] = smollm(args) if m == "smollm2" else family(m, args)
        sys.stdout.flush()
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
