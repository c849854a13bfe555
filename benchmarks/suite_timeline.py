"""The test suite's timeline: when each test file ran on each pytest-xdist worker (run by hand).

As a pytest plugin it logs every test's start and end, per worker, into $POSLENS_TIMELINE (a directory); as a script
it prints each worker's files with their start, end and length, and when each worker's last test ended, so an idle
tail (a long file started last) shows:

    POSLENS_TIMELINE=/tmp/tl PYTHONPATH=benchmarks .venv/bin/python -m pytest -q -p suite_timeline
    .venv/bin/python benchmarks/suite_timeline.py /tmp/tl
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _log(event: str, **fields) -> None:
    where = os.environ.get("POSLENS_TIMELINE")
    if not where:
        return
    Path(where).mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(Path(where) / f"{worker}.jsonl", "a") as f:
        f.write(json.dumps({"ev": event, "t": time.time(), **fields}) + "\n")


def pytest_runtest_logstart(nodeid, location) -> None:
    _log("start", id=nodeid)


def pytest_runtest_logfinish(nodeid, location) -> None:
    _log("end", id=nodeid)


def summary(directory: Path, shortest: float = 8.0) -> str:
    """Each worker's files (those of at least `shortest` seconds) and the end of its last test, in seconds from the
    first test's start."""
    workers = {p.stem: [e for e in map(json.loads, p.read_text().splitlines()) if "id" in e]
               for p in directory.glob("*.jsonl")}
    if len(workers) > 1:  # under xdist the controller hears every worker's tests again: the workers' own logs only
        workers.pop("main", None)
    if not workers:
        return f"{directory}: no timeline (run pytest with POSLENS_TIMELINE={directory} -p suite_timeline)"
    t0 = min(e["t"] for events in workers.values() for e in events)
    lines = []
    for worker, events in sorted(workers.items()):
        files: dict[str, list[float]] = {}
        for e in events:
            span = files.setdefault(e["id"].split("::")[0], [e["t"], e["t"]])
            span[0], span[1] = min(span[0], e["t"]), max(span[1], e["t"])
        lines.append(f"{worker}: last test ended at {max(e['t'] for e in events) - t0:.1f} s")
        lines += [f"  {a - t0:7.1f} {b - t0:7.1f} {b - a:6.1f} s  {name}" for name, (a, b) in files.items()
                  if b - a >= shortest]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: suite_timeline.py DIRECTORY")
    print(summary(Path(sys.argv[1])))
