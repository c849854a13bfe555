"""Benchmark: the test suite's wall time, its files run two at a time (pytest-xdist, pyproject's addopts: ``-n auto
--dist loadfile``) against one process (``-n 0``, the suite before), side by side. Run by hand, not a test.

Each arm runs ``python -m pytest -q -n N --dist loadfile`` on the same test paths (default: the whole suite) in a
child process; the arms alternate (one process, then xdist, then one process, ...) --rounds times so that both meet
the same load of a shared machine. Printed per run: wall seconds, CPU seconds (user + system of pytest and every
process it started: what the load of a shared machine inflates least) and pytest's last line; then per arm the median
wall and CPU seconds, and the median of the per-round wall ratios (one process over xdist: above 1, xdist is
faster). A quiet machine is the one to quote: on a loaded one the xdist arm's two workers take a larger share of the
cores than the one-process arm gets. --json PATH writes every timing.

    nice .venv/bin/python benchmarks/suite.py --rounds 1 --json /tmp/suite.json
    nice .venv/bin/python benchmarks/suite.py tests/test_sweep.py tests/test_train.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_arm(workers: str, paths: list[str]) -> dict:
    """One run of pytest with `workers` (``0``: one process; ``auto``: pyproject's default) on `paths`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", workers, "--dist", "loadfile", *paths],
                         cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    last = (res.stdout.strip().splitlines() or ["(no output)"])[-1]
    return {"workers": workers, "wall_s": wall, "cpu_s": cpu, "returncode": res.returncode, "summary": last}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="test files or directories (default: the whole suite)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of (one process, xdist)")
    parser.add_argument("--json", default=None, help="write every timing to this file")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    runs: list[dict] = []
    for r in range(args.rounds):
        for workers in ("0", "auto"):
            run = run_arm(workers, args.paths) | {"round": r}
            runs.append(run)
            print(f"round {r + 1} -n {workers:<4}: {run['wall_s']:7.1f} s wall, {run['cpu_s']:7.1f} s CPU, exit "
                  f"{run['returncode']}: {run['summary']}", flush=True)
    arms = {w: [x for x in runs if x["workers"] == w] for w in ("0", "auto")}
    for w, xs in arms.items():
        print(f"-n {w:<4}: median {statistics.median(x['wall_s'] for x in xs):.1f} s wall, "
              f"{statistics.median(x['cpu_s'] for x in xs):.1f} s CPU over {len(xs)} run(s)")
    ratios = [a["wall_s"] / b["wall_s"] for a, b in zip(arms["0"], arms["auto"])]
    print(f"wall, one process over xdist: median {statistics.median(ratios):.2f}x over {len(ratios)} round(s) "
          f"({', '.join(f'{x:.2f}' for x in ratios)})")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "ratios": ratios}, indent=2) + "\n")
    return 0 if all(x["returncode"] == 0 for x in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
