"""Benchmark: this tree's capture against the previous release's, each as a ratio to a plain forward (by hand).

The bar of issue #7: the averaged-scores path may not slow down when the capture moves onto the hook engine, i.e.
(poslens / plain) now must stay within 5% of (poslens / plain) in the previous release. Both ratios are measured
in this one run, interleaved: round r runs the previous release's `benchmarks/capture.py` and then this tree's
(the order alternates per round), each in its own process on the same model, batches and thread count, with
only the `plain` and `poslens` methods. The previous release is checked out into a temporary git worktree.

    .venv/bin/python benchmarks/capture_vs_release.py --release afb3a39 --rounds 3 -- --model smollm2-135m \
        --batch 2 --seq-len 512 --batches 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(tree: Path, extra: list[str], out: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cmd = [sys.executable, str(tree / "benchmarks" / "capture.py"), "--methods", "plain,poslens",
           "--reference", "none", "--out", str(out), *extra]
    subprocess.run(cmd, check=True, env=env, cwd=tree, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def ratio(result: dict) -> float:
    """poslens wall time over plain wall time (medians over the repeats of one process)."""
    return result["methods"]["poslens"]["wall_ratio"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--release", default="afb3a39", help="git revision of the previous release")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="write all results as JSON here")
    p.add_argument("extra", nargs=argparse.REMAINDER, help="-- then arguments for benchmarks/capture.py")
    args = p.parse_args()
    extra = [a for a in args.extra if a != "--"]
    with tempfile.TemporaryDirectory(prefix="poslens-release-") as tmp:
        old = Path(tmp) / "release"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.release], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            rows = []
            for r in range(args.rounds):
                order = [("release", old), ("now", ROOT)]
                for name, tree in order if r % 2 == 0 else order[::-1]:
                    res = measure(tree, extra, Path(tmp) / f"{name}-{r}.json")
                    rows.append({"round": r, "tree": name, "ratio": ratio(res), "raw": res})
                    print(f"round {r} {name:8s} poslens/plain = {rows[-1]['ratio']:.3f}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    now = statistics.median(x["ratio"] for x in rows if x["tree"] == "now")
    rel = statistics.median(x["ratio"] for x in rows if x["tree"] == "release")
    print(f"median ratio to a plain forward: now {now:.3f}, release {rel:.3f}; now / release = {now / rel:.3f} "
          f"(bar: <= 1.05)")
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "now": now, "release": rel, "argv": sys.argv}, indent=1))


if __name__ == "__main__":
    main()
