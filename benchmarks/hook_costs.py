"""Benchmark: what each group of hook points costs when read, per family, against a plain forward (run by hand).

The same models and tokens as `benchmarks/families.py` (a random model of the family's tiny test config widened to
`--hidden`, `--layers` layers, heads of 64; 2 x 256 tokens), one thread. Arms, interleaved (the order rotates every
round), each timed in CPU seconds of this process; every hooked arm has a reader (a hook that takes the value and keeps
nothing) at the points named, and logits:

* plain:            `model(ids)` (SDPA);
* all:              every point;
* pattern_only:     only `attn.hook_pattern` (the dense map, and attention's output from it);
* no_result:        every point but `attn.hook_result`;
* no_maps_result:   every point but the scores, the pattern and the per-head results (the model's kernel runs);
* then, each without the scores, the pattern and the results, and without one more group: `-norms` (every `ln*`
  point), `-inputs` (the per-head inputs and `hook_mlp_in`), `-qkv` (`attn.hook_q/k/v`, `hook_rot_q/k`, `hook_z`),
  `-mlp` (the `mlp.*` points).

Reported per arm: the geometric mean of its paired ratios to the plain forward of the same round, with a 95%
t-interval over the rounds. A group's cost is read off the differences between arms (e.g. all - no_result: the
per-head results).

    PYTHONPATH=src:tests .venv/bin/python benchmarks/hook_costs.py --families gpt_neox gpt2 --repeats 7
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from families import add_shape_args, interleaved, paired, read, setup  # noqa: E402

from poslens.engine.hooks import HookedModel  # noqa: E402

MAPS = ("attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_result")
GROUPS = {
    "-norms": lambda p: ".ln" in f".{p}" or p.startswith("ln_final"),
    "-inputs": lambda p: p.endswith(("hook_attn_in", "hook_q_input", "hook_k_input", "hook_v_input", "hook_mlp_in")),
    "-qkv": lambda p: p.endswith(("attn.hook_q", "attn.hook_k", "attn.hook_v", "hook_rot_q", "hook_rot_k", "hook_z")),
    "-mlp": lambda p: ".mlp." in p,
}


def arms_of(hm: HookedModel) -> dict[str, list[str]]:
    """Arm name -> the points it reads."""
    points = hm.points
    base = [p for p in points if not p.endswith(MAPS)]
    arms = {"all": points, "pattern_only": [p for p in points if p.endswith("attn.hook_pattern")],
            "no_result": [p for p in points if not p.endswith("attn.hook_result")], "no_maps_result": base}
    arms.update({f"no_maps_result {g}": [p for p in base if not drop(p)] for g, drop in GROUPS.items()})
    return arms


def measure(family: str, args) -> dict:
    model, hm, ids = setup(family, args)

    def arm(points: list[str]):
        hooks = {p: read for p in points}
        return lambda: hm.run(ids, hooks=hooks, logits=True)

    methods = {"plain": lambda: model(input_ids=ids, use_cache=False), **{n: arm(p) for n, p in arms_of(hm).items()}}
    with torch.no_grad():
        times = interleaved(methods, args.repeats)
    return {name: paired(t, times["plain"]) for name, t in times.items() if name != "plain"} | {"all_times": times}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(p)
    args = p.parse_args()
    torch.set_num_threads(1)
    out = {"config": vars(args), "torch": torch.__version__, "families": {}}
    for family in args.families:
        r = out["families"][family] = measure(family, args)
        print(family + ": " + "; ".join(f"{name} {g[0]:.3f} [{g[1]:.3f}, {g[2]:.3f}]" for name, g in r.items()
                                        if name != "all_times"), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
