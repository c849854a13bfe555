"""Benchmark: the length maps' capture (`poslens.analyses.length.maps.LengthMaps.update`: one hooked forward with the
averaged scores, log-probabilities, log-partition and the per-sequence lag fit), this tree against another tree's
`src`, side by side (run by hand, not a test).

The model: a random Llama of the `pe-sinks` sweep's shape (4 layers, d = 64, 8 query heads, 4 key/value heads,
vocabulary 2,000; RoPE), one batch of 4 x 512 tokens (the length section's longest evaluation length, 8L), 8 groups,
the lag fit at 64, 128, 256 and 512 tokens, as `poslens length` builds it (probabilities off). Each arm is a child
process that captures one warm-up batch, then `--updates` batches, and prints its CPU seconds per update (one
thread, subnormals flushed as every poslens command runs). The arms alternate (base first in odd rounds); the ratio
printed is this tree's CPU time over the base's per round, with the geometric mean and its 95% t-interval. Both
trees' sums are written and compared: a speed figure is for the same numbers (bit for bit, or else the largest
difference relative to the largest sum of the same tensor is printed).

    git archive REV src | tar -x -C /tmp/base
    .venv/bin/python benchmarks/length_maps.py --base /tmp/base/src --rounds 6 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import ratio_interval  # noqa: E402 (benchmarks/train.py)

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import resource, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from poslens.analyses.length.maps import LengthMaps
torch.set_num_threads(1)
torch.set_flush_denormal(True)
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=2000, hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, max_position_embeddings=64)
cfg._attn_implementation = "sdpa"
model = LlamaForCausalLM(cfg).eval()
cap = LengthMaps(model, groups=8, probs=False, lengths=[64, 128, 256, 512])
ids = torch.randint(0, 2000, (4, 512), generator=torch.Generator().manual_seed(0))
updates = int(sys.argv[1])
with torch.no_grad():
    cap.update(ids)
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(updates):
        cap.update(ids)
    after = resource.getrusage(resource.RUSAGE_SELF)
torch.save({**cap.state_dict(), **{"lag/" + k: v for k, v in cap.lags.sums.items()}}, sys.argv[2])
print((after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) / updates)
"""


def arm(src: Path, updates: int, sums: Path) -> float:
    """CPU seconds per update of one child process running the tree at `src`; its sums written to `sums`."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, "-c", CHILD, str(updates), str(sums)], env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        sys.exit(f"the arm with {src} failed: {done.stderr.strip()[-2000:]}")
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="the other tree's src directory (e.g. from git archive)")
    p.add_argument("--rounds", type=int, default=6, help="paired rounds (the order alternates)")
    p.add_argument("--updates", type=int, default=12, help="timed updates per arm")
    p.add_argument("--json", default=None, help="write every timing here")
    a = p.parse_args()
    import torch

    trees = {"base": Path(a.base).resolve(), "now": ROOT / "src"}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            t = {}
            for name in (("base", "now") if r % 2 == 0 else ("now", "base")):
                t[name] = arm(trees[name], a.updates, Path(tmp) / f"{name}.pt")
            rows.append({"round": r, **t, "ratio": t["now"] / t["base"]})
            print(f"round {r}: base {t['base']:.3f} s, now {t['now']:.3f} s of CPU per update: "
                  f"{rows[-1]['ratio']:.3f}", flush=True)
        base, now = torch.load(Path(tmp) / "base.pt"), torch.load(Path(tmp) / "now.pt")
        same = base.keys() == now.keys() and all(torch.equal(base[k], now[k]) for k in base)
        # else how far apart: the largest |difference| relative to the largest |sum| of the same tensor
        rel = max(float((base[k] - now[k]).abs().nan_to_num().max() / base[k].abs().nan_to_num().max().clamp(min=1e-30))
                  for k in base if base[k].is_floating_point()) if base.keys() == now.keys() else float("nan")
    g, lo, hi = ratio_interval([x["ratio"] for x in rows])
    print(f"now / base, CPU per update, {a.rounds} rounds: {g:.3f} [{lo:.3f}, {hi:.3f}] (95% t on the log ratios); "
          f"sums bit for bit the same: {same} (largest difference relative to the tensor's largest sum {rel:.1e}); "
          f"load average {os.getloadavg()[0]:.1f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rounds": rows, "ratio": g, "lo": lo, "hi": hi, "same_sums": same,
                                            "relative_difference": rel, "base": str(trees["base"]),
                                            "updates": a.updates}, indent=1))


if __name__ == "__main__":
    main()
