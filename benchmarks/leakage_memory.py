"""Benchmark: the memory of `poslens leakage`'s estimates phase (after the passes: jackknife replicates, contrasts,
the sink heads' cross-fitted shares) against the grouped sums it reads (run by hand, not a test).

    .venv/bin/python benchmarks/leakage_memory.py                         # SmolLM2-135M, Gemma's passes, 256 tokens
    .venv/bin/python benchmarks/leakage_memory.py --seq-len 384 --out benchmarks/results/cpu-DATE-leakage-memory.json
    PYTHONPATH=OTHER/src python benchmarks/leakage_memory.py              # the same on another tree, side by side

The passes are those the report runs on Gemma-3-270M (the original, the `mean` intervention, the offset null and the
intervention again on its windows; no predecessor); the sequences are few (one per group): the sums' size depends on
the groups, layers, heads and tokens, not on the number of sequences. A thread samples the process's resident memory
every 20 ms. Reported: the resident memory when the passes end (`rss_after_passes`), the peak while the estimates are
computed (`peak_estimates`), the bytes of every pass's sums (`sums`), and the peak's excess over the memory at the
passes' end in units of one per-head float64 mean map [L, H, T, T] (`excess_maps`): what `Leakage.memory` budgets.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
import psutil  # noqa: E402
import torch  # noqa: E402


def main() -> None:
    from poslens.analyses.leakage import run as leakage_run
    from poslens.analyses.leakage.run import LeakageConfig, run_leakage

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--out", default=None, help="write the numbers as JSON here")
    ap.add_argument("--keep", default=None, help="keep the run directory here (two trees' runs compared number for "
                                                 "number)")
    args = ap.parse_args()

    proc, samples, marks = psutil.Process(), [], {}
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            samples.append((time.perf_counter(), proc.memory_info().rss))
            time.sleep(0.02)

    finish = leakage_run.Leakage.finish

    def timed_finish(self, job, passes):
        marks["sums"] = sum(t.numel() * t.element_size() for p in passes for s in p.statistics
                            if hasattr(s, "sums") for t in (*s.sums.sums.values(), *s.sums.counts.values()))
        shape = next(s for s in passes[0].statistics if hasattr(s, "sums")).sums.sums["scores"].shape[1:]
        marks["per_head_map"] = int(torch.Size(shape).numel() * 8)
        marks["start"] = time.perf_counter()
        try:
            return finish(self, job, passes)
        finally:
            marks["end"] = time.perf_counter()

    leakage_run.Leakage.finish = timed_finish
    cfg = LeakageConfig(model=args.model, seq_len=args.seq_len, num_sequences=args.groups, batch_size=1,
                        groups=args.groups, early_queries=32, max_offset=args.seq_len // 2 - 1,
                        interventions=["mean"], nulls=["offset"], predecessor=False, figures=False,
                        min_offset=64)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run_leakage(cfg, args.keep or Path(tmp) / "run", progress=False)
    wall = time.perf_counter() - t0
    stop.set()
    thread.join()
    before = [r for t, r in samples if t <= marks["start"]]
    during = [r for t, r in samples if marks["start"] <= t <= marks["end"]]
    out = {"model": args.model, "seq_len": args.seq_len, "groups": args.groups, "torch": torch.__version__,
           "sums": marks["sums"], "per_head_map": marks["per_head_map"], "rss_after_passes": before[-1],
           "peak_passes": max(before), "peak_estimates": max(during), "estimates_s": marks["end"] - marks["start"],
           "wall_s": wall}
    out["excess"] = out["peak_estimates"] - out["rss_after_passes"]
    out["excess_maps"] = out["excess"] / out["per_head_map"]
    gib = 2 ** 30
    print(f"sums {out['sums'] / gib:.2f} GiB; one per-head float64 map {out['per_head_map'] / gib:.3f} GiB; "
          f"resident after the passes {out['rss_after_passes'] / gib:.2f} GiB (peak in the passes "
          f"{out['peak_passes'] / gib:.2f}); peak in the estimates {out['peak_estimates'] / gib:.2f} GiB: "
          f"{out['excess'] / gib:.2f} GiB more = "
          f"{out['excess_maps']:.1f} per-head maps; estimates {out['estimates_s']:.0f} s, whole run {wall:.0f} s")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
