#!/usr/bin/env python3
"""Regenerate the numbers block of a docs page from a `poslens reproduce` run, so the docs cannot drift from the report.

    python scripts/docs_numbers.py RUN [--doc docs/results.md] [--check]

RUN is a directory `poslens reproduce` wrote; its run.json gives every number of the block: the ledger headlines
(`poslens.report.claims.LedgerCount.headline`, the report's own words) and one line per row (verdict and key
number, as in the report's summary). The block sits between the markers BEGIN and END in --doc; everything
outside them is left as it is. --check writes nothing and exits 1 when the block differs from what RUN gives.
The block names the run by its directory name, its date and size, never by a temporary path or a commit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from poslens.report.claims import VERDICTS, LedgerCount

BEGIN = "<!-- docs-numbers: begin (scripts/docs_numbers.py regenerates this block from a run; do not edit it) -->"
END = "<!-- docs-numbers: end -->"


def read_run(run: Path) -> dict:
    """RUN/run.json of a reproduce run; a one-line error (SystemExit) otherwise."""
    try:
        meta = json.loads((run / "run.json").read_text())
    except (OSError, ValueError):
        fail(f"docs_numbers.py: {run} has no readable run.json; pass a directory `poslens reproduce` wrote")
    if not isinstance(meta, dict) or meta.get("kind") != "reproduce" or "claims" not in meta.get("metrics", {}):
        fail(f"docs_numbers.py: {run}/run.json is not a complete reproduce run; pass one `poslens reproduce` wrote")
    return meta


def block(run: Path, meta: dict) -> str:
    """The block, markers included: the run's name, date and size, each ledger's headline, then one line per row
    grouped by section."""
    prov, metrics = meta.get("provenance", {}), meta["metrics"]
    version = prov.get("versions", "").split(",")[0]
    out = [BEGIN, "", f"From the reproduce run `{run.name}` ({version}, {prov.get('date', 'date not recorded')}; "
           f"{prov.get('size', 'full').split(':')[0]} size).", ""]
    by_basis = metrics.get("ledgers_by_basis", {})
    for name, counts in metrics["ledgers"].items():
        led = LedgerCount(name, {v: counts.get(v, 0) for v in VERDICTS}, by_basis.get(name, {}))
        out.append(f"- **{led.headline()}**")
    section = None
    for c in metrics["claims"]:
        if c.get("section") != section:
            section = c.get("section")
            out += ["", f"*{section}*", ""]
        out.append(f"- {c['verdict']}: {c['claim']} ({c['key']}) `{c['id']}`")
    return "\n".join(out + ["", END])


def replace_block(text: str, new: str, doc: Path) -> str:
    """`text` with the block between BEGIN and END replaced by `new` (which carries the markers)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        fail(f"docs_numbers.py: {doc} needs one block between the lines {BEGIN!r} and {END!r}; add them where "
                 "the numbers go")
    return text[:text.index(BEGIN)] + new + text[text.index(END) + len(END):]


def fail(message: str) -> None:
    """A bad input: the one-line message on stderr, exit status 2 (nothing written)."""
    print(message, file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="a directory `poslens reproduce` wrote")
    ap.add_argument("--doc", type=Path, default=Path("docs/results.md"), help="the page (default docs/results.md)")
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 when the block is not the run's")
    a = ap.parse_args(argv)
    if not a.doc.is_file():
        fail(f"docs_numbers.py: {a.doc}: no such file; pass the page with --doc")
    text = a.doc.read_text()
    new = replace_block(text, block(a.run, read_run(a.run)), a.doc)
    if a.check:
        if new != text:
            print(f"{a.doc}: the numbers block differs from {a.run}'s run.json; run scripts/docs_numbers.py "
                  f"{a.run} --doc {a.doc}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        a.doc.write_text(new)
    print(f"{a.doc}: numbers block {'rewritten' if new != text else 'already up to date'} from {a.run}/run.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
