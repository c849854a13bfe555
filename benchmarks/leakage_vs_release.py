"""`poslens leakage smollm2-135m` at its defaults with the tree before issue 32's gauge-invariant decomposition and
with this tree, side by side: the bar "under 10 minutes on 2 CPU cores, side by side with the previous release".

The previous tree is RELEASE = db51a74, the parent of 4c36d06 (the decomposition: per-sequence two-way fits, the
lag log-partition). `poslens leakage`'s option defaults (64 sequences of 128 tokens, batches of 8, 8 groups,
interventions mean and patch:inside:1@0, nulls offset and circular, the predecessor's test) last changed at 077f54e
(2026-11-25) and are the same in both trees; what the defaults run last changed at 2b2a58b (the offset null runs
every intervention on windows inside documents: 7 passes), also in both. So the ratio is this round's cost alone:
the decomposition, the cross-fitted sink heads, the paired offset-null records.

Each version runs as its own process (`benchmarks/pipeline_vs_release.py`'s `run`: the release's `src/` from `git
archive`, this tree's `src/`), interleaved release, current, current, release, ..., on the same machine; reported:
wall and CPU seconds of each process (model loading and the corpus included), the ratios current / release per
repeat and their median, the load average, and which run.json metrics and tensors the two share (the metrics were
renamed in between: docs/leakage.md, "Renamed metrics", so most differ by name, not by value).

    python benchmarks/leakage_vs_release.py                  # the bar: SmolLM2-135M at the defaults, 2 repeats
    python benchmarks/leakage_vs_release.py --tiny           # a check that both trees run (a random 3-layer Llama)

Take the timing on a quiet machine: on a shared one the ratio of CPU times is the steadier of the two.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from pipeline_vs_release import ROOT, TINY, compare, interleaved, release_tree  # noqa: E402

RELEASE = "db51a74"  # the parent of 4c36d06, issue 32's gauge-invariant decomposition
TINY_ARGS = ["--seq-len", "32", "--num-sequences", "8", "--batch-size", "2", "--groups", "4", "--early-queries", "10"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--release", default=RELEASE, help=f"git ref of the previous tree (default {RELEASE})")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tiny", action="store_true", help="a random 3-layer Llama (SmolLM2's tokenizer) at 8 x 32 "
                    "tokens: that both trees run, not a timing")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each version")
    ap.add_argument("--current", type=Path, default=ROOT / "src", help="the code to compare (default this tree's src)")
    args = ap.parse_args()
    model = [TINY, "--tokenizer", "smollm2-135m"] if args.tiny else [args.model]
    argv = ["leakage", *model, *(TINY_ARGS if args.tiny else [])]
    results = {"release": args.release, "argv": ["poslens", *argv], "load_average_before": os.getloadavg()}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        trees = {"release": release_tree(args.release, tmp), "current": args.current}
        times, ratios = interleaved(trees, argv, tmp, args.repeats, "leakage")
        shared = compare(tmp / "leakage-release-0", tmp / "leakage-current-0")
        results.update({"seconds_wall_cpu": times, "ratios_current_over_release": ratios,
                        "median_ratio_wall": statistics.median(ratios["wall"]),
                        "median_ratio_cpu": statistics.median(ratios["cpu"]),
                        "tensors_compared": shared["tensors_compared"],
                        "tensors_differing": len(shared["tensors_differing"]),
                        "tensors_only_release": len(shared["tensors_only_release"]),
                        "tensors_only_current": len(shared["tensors_only_current"]),
                        "metrics_differing": len(shared["metrics_differing"])})
    results["load_average_after"] = os.getloadavg()
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
