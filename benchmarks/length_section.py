"""Benchmark: the report's length section, this tree against the previous release, side by side on the same models.

The section (`poslens.report.sections.length`) runs `poslens length` once per variant of the sweep, its seeds
together, on the held-out split to 8L tokens. Both trees build it in a child process each (the release from an
exported tree, `git archive REV src`), on the same sweep models read from one model cache (trained first by this
tree if missing, not timed), with the same section sizes, each into a fresh parts directory (nothing reused), the
order alternating over repeats. Reported per build: wall and CPU seconds of the child, and its rows' verdicts and
key numbers; the rows both trees have must give the same numbers (the speed is for the same results). The ratio
is this tree's wall time over the release's in the same repeat. A tree with `poslens.engine.workers` starts its
workers' server first thing in the child, as `reproduce` does on entry (there other sections run before this one
while the server imports; here only the child's own imports do, so the child's wall still holds part of it).

The default setting is small: the `pe-sinks` sweep's shape (4 layers, d = 64, 8 heads, L = 64, evaluated to 512
tokens: the full run's) with 6 training steps (the evaluation costs the same whatever the weights), 3 seeds, 8
held-out sequences per model in 4 groups (the full run: 32 in 8), the profile at every second query (as the full
run).

    POSLENS_CACHE=/tmp/bench-cache .venv/bin/python benchmarks/length_section.py --release 580b43e \
        --json benchmarks/results/length_section.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"sweep": "pe-sinks", "sweep_train": "steps=6+warmup=2+eval_every=3+save_every=0", "sweep_seeds": [0, 1, 2],
         "sequences": 8, "groups": 4, "profile_every": 2}

CHILD = """
import json, sys, time
try:  # as `reproduce` does on entry: the worker processes' server starts and imports beside the work (trees since
    from poslens.engine import workers  # 2026-11-30; the release spawns each worker, which imports for itself)
    workers.start()
except ImportError:
    pass
from pathlib import Path
from poslens.report.context import Context
from poslens.report.section import spec
root, size, name = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
(root / "parts").mkdir(parents=True)
ctx = Context(root / "report", root / "report", root / "parts", 400, 0, True, False, draw=True)
(root / "report").mkdir()
sp = spec(name)
t0 = time.perf_counter()
sec = sp.build(ctx, sp.size(True, size))
print(json.dumps({"build_s": time.perf_counter() - t0,
                  "rows": {c.id: [c.verdict, c.key_number()] for c in sec.claims},
                  "context": [list(x) for x in sec.context]}))
"""


def export(rev: str) -> Path:
    """The src tree of git revision `rev`, exported into a temporary directory."""
    where = Path(tempfile.mkdtemp(prefix="poslens-release-"))
    archive = subprocess.run(["git", "archive", rev, "src"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where / "src"


def build(src: Path, size: dict, work: Path, section: str = "length") -> dict:
    """Build the report section `section` with the poslens in `src` in a child process; its wall and CPU seconds
    (the child's and its pool workers')."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, str(work), json.dumps(size), section], env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"the build with {src} failed: {done.stderr.strip()[-3000:]}")
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {**out, "wall_s": wall, "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
            "load": os.getloadavg()[0]}


def side_by_side(section: str, size: dict, release: str, repeats: int, out: str | None) -> None:
    """Build report section `section` at `size` with this tree and the release `release`, `repeats` times each in
    alternating order, on the sweep models (trained first if missing, not timed); print each build's seconds and
    the rows both trees have that differ; write the measurements to `out` (JSON) if given."""
    sys.path.insert(0, str(ROOT / "src"))
    from poslens.report.context import Context
    from poslens.report.section import spec
    from poslens.report.sweep import sweep_models

    with tempfile.TemporaryDirectory() as tmp:  # the models, trained first if missing (not timed)
        sweep_models(Context(Path(tmp), Path(tmp), Path(tmp), 1, 0, True, True), spec(section).size(True, size))
    trees = {"now": ROOT / "src", "release": export(release)}
    runs: list[dict] = []
    for r in range(repeats):
        for name in (("now", "release") if r % 2 else ("release", "now")):
            with tempfile.TemporaryDirectory() as work:
                m = build(trees[name], size, Path(work) / "w", section)
            runs.append({"tree": name, "repeat": r, **m})
            print(f"{name}: {m['wall_s']:.1f} s wall, {m['cpu_s']:.1f} s CPU (load {m['load']:.1f})", flush=True)
    ratios = []
    for r in range(repeats):
        now, rel = (next(x for x in runs if x["tree"] == t and x["repeat"] == r) for t in ("now", "release"))
        ratios.append({"wall": now["wall_s"] / rel["wall_s"], "cpu": now["cpu_s"] / rel["cpu_s"]})
        shared = sorted(set(now["rows"]) & set(rel["rows"]))
        same = {k: now["rows"][k] == rel["rows"][k] for k in shared}
        print(f"repeat {r}: now / release = {ratios[-1]['wall']:.3f} wall, {ratios[-1]['cpu']:.3f} CPU; rows both "
              f"have: {sum(same.values())} of {len(shared)} with the same verdict and key number"
              + "".join(f"\n  differs: {k}: now {now['rows'][k]}, release {rel['rows'][k]}"
                        for k, ok in same.items() if not ok))
    if out:
        Path(out).write_text(json.dumps({"section": section, "sizes": size, "release": release, "runs": runs,
                                         "ratios": ratios}, indent=1))


def main(section: str = "length", sizes: dict = SIZES, release: str = "580b43e", doc: str = __doc__) -> None:
    """The command line of a section's side-by-side benchmark (`trained_section.py` calls it for Section 4.2)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--release", default=release, help="the earlier tree's git revision")
    p.add_argument("--sizes", default="{}", help="JSON: section sizes over the defaults (keys both trees know)")
    p.add_argument("--repeats", type=int, default=1, help="builds per tree, the order alternating")
    p.add_argument("--json", default=None, help="write the measurements here")
    a = p.parse_args()
    side_by_side(section, {**sizes, **json.loads(a.sizes)}, a.release, a.repeats, a.json)


if __name__ == "__main__":
    main()
