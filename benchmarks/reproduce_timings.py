"""Two `poslens reproduce` runs side by side: per-section wall and CPU seconds from each run's run.json.

The runs are measured by the user (each tree's own README command, started together on one machine, each with its
own empty POSLENS_CACHE); this script only reads what each run recorded (`timings`: per section `seconds`
and `cpu_seconds`, process and finished workers) and prints a Markdown table with the ratio second / first, the
sections either run lacks marked, and the totals. Nothing is estimated.

    python benchmarks/reproduce_timings.py BEFORE/poslens-out AFTER/poslens-out --labels before after
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def timings(run: Path) -> dict:
    """run.json's timings of a reproduce run directory: {"seconds", "cpu_seconds", "sections": {name: {...}}} and,
    since the sweeps train before the sections, "sweeps" ({"seconds", "cpu_seconds"})."""
    return json.loads((run / "run.json").read_text())["timings"]


def table(first: dict, second: dict, labels: tuple[str, str]) -> str:
    """The Markdown table of the two runs' sections (in the first run's order, then the second's new ones)."""
    # a run since 2026-11-28 trains every sweep before its first section ("sweeps"): a row of its own
    a, b = (({"(sweeps, before the sections)": t["sweeps"]} if "sweeps" in t else {}) | t["sections"]
            for t in (first, second))
    names = list(a) + [n for n in b if n not in a]
    rows = [f"| section | {labels[0]} wall (s) | {labels[1]} wall (s) | {labels[1]} / {labels[0]} wall | "
            f"{labels[0]} CPU (s) | {labels[1]} CPU (s) | {labels[1]} / {labels[0]} CPU |",
            "| --- | --- | --- | --- | --- | --- | --- |"]

    def cell(t: dict | None, key: str) -> str:
        return "not run" if t is None else f"{t[key]:,.0f}"

    def ratio(x: dict | None, y: dict | None, key: str) -> str:
        return "" if x is None or y is None or not x[key] else f"{y[key] / x[key]:.3f}"

    for n in names:
        x, y = a.get(n), b.get(n)
        rows.append(f"| {n} | {cell(x, 'seconds')} | {cell(y, 'seconds')} | {ratio(x, y, 'seconds')} | "
                    f"{cell(x, 'cpu_seconds')} | {cell(y, 'cpu_seconds')} | {ratio(x, y, 'cpu_seconds')} |")
    common = [n for n in names if n in a and n in b]
    for label, keep in (("all sections", names), ("sections both runs have", common)):
        x = {k: sum(a[n][k] for n in keep if n in a) for k in ("seconds", "cpu_seconds")}
        y = {k: sum(b[n][k] for n in keep if n in b) for k in ("seconds", "cpu_seconds")}
        rows.append(f"| **{label}** | {x['seconds']:,.0f} | {y['seconds']:,.0f} | {ratio(x, y, 'seconds')} | "
                    f"{x['cpu_seconds']:,.0f} | {y['cpu_seconds']:,.0f} | {ratio(x, y, 'cpu_seconds')} |")
    x, y = first, second
    rows.append(f"| **the run (run.json's total)** | {x['seconds']:,.0f} | {y['seconds']:,.0f} | "
                f"{ratio(x, y, 'seconds')} | {x['cpu_seconds']:,.0f} | {y['cpu_seconds']:,.0f} | "
                f"{ratio(x, y, 'cpu_seconds')} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("first", type=Path, help="the first reproduce run directory (e.g. the tree before)")
    p.add_argument("second", type=Path, help="the second reproduce run directory (e.g. this tree)")
    p.add_argument("--labels", nargs=2, default=("first", "second"))
    args = p.parse_args()
    print(table(timings(args.first), timings(args.second), tuple(args.labels)))


if __name__ == "__main__":
    main()
