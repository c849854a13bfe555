"""Benchmark: the sweeps `poslens reproduce` trains before its sections, alone (run by hand, not a test).

`reproduce` trains every matrix its model sections read (`poslens.report.sweep.planned_sweeps`: the sweep of
the length, trained-model and leakage sections and the leakage section's BOS sweep) as one set before the first
section (`train_sweeps`). This script trains exactly that set, with --seeds in place of the presets' seeds where
given, into the poslens cache (set POSLENS_CACHE to an empty directory to time it cold), and prints the wall and
CPU seconds (this process and its finished worker processes) and the models trained. Compare it side by side with
an older tree's `poslens sweep` of the same models (BENCHMARKS.md "The sweep the full `reproduce` trains").

    POSLENS_CACHE=/tmp/empty /usr/bin/time -v .venv/bin/python benchmarks/reproduce_sweeps.py --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import resource
import time


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and its finished children."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    from poslens.report.reproduce import plan
    from poslens.report.sweep import planned_sweeps, train_sweeps

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the sweeps of `reproduce --quick`")
    ap.add_argument("--seeds", default=None, help="comma-separated seeds instead of the presets' (e.g. 0,1,2)")
    ap.add_argument("--json", default=None, help="write the timings here too")
    args = ap.parse_args()
    steps = plan(args.quick, True, None)
    if args.seeds:
        seeds = [int(s) for s in args.seeds.split(",")]
        steps = [(spec, {**size, "sweep_seeds": seeds} if "sweep" in size else size) for spec, size in steps]
    configs = planned_sweeps(steps)
    ctx = type("Ctx", (), {"progress": True})()
    t0, c0 = time.perf_counter(), cpu_seconds()
    trained = train_sweeps(ctx, configs)
    out = {"sweeps": [c.preset for c in configs], "seeds": args.seeds, "models_trained": len(set(trained)),
           "seconds": time.perf_counter() - t0, "cpu_seconds": cpu_seconds() - c0}
    print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
