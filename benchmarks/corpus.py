"""Benchmark: building the embedded corpus with its source files parsed by worker processes against parsing them in
this process, one after the other (run by hand, not a test).

Each build reads every source from the installed files (no cache); the repeats alternate the order, and the two
builds' documents are checked identical (same order, same text).

    .venv/bin/python benchmarks/corpus.py --repeats 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import time

from poslens.engine import corpus


def timed(workers: int) -> tuple[float, str]:
    start = time.perf_counter()
    docs, _ = corpus.build(workers)
    took = time.perf_counter() - start
    return took, hashlib.sha256(json.dumps(docs).encode()).hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    parallel = corpus._workers()
    runs: dict[int, list[float]] = {1: [], parallel: []}
    digests = set()
    for r in range(args.repeats):
        for workers in ((1, parallel) if r % 2 == 0 else (parallel, 1)):
            took, digest = timed(workers)
            runs[workers].append(took)
            digests.add(digest)
            print(f"repeat {r + 1}, {workers} worker(s): {took:.1f} s")
    assert len(digests) == 1, "the builds differ"
    serial, fast = statistics.median(runs[1]), statistics.median(runs[parallel])
    print(json.dumps({"cores": os.cpu_count(), "python": platform.python_version(), "workers": parallel,
                      "serial_s": round(serial, 1), "parallel_s": round(fast, 1), "speedup": round(serial / fast, 2),
                      "identical": True, "sha256": digests.pop()[:16]}))


if __name__ == "__main__":
    main()
