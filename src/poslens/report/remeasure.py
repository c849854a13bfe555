"""Re-measure claims of a `poslens reproduce` report and print their tests:

    python -m poslens.report.remeasure poslens-out kim-41-depth-alpha0 [ID ...]

Reads the report's run.json for its settings (seed, Monte Carlo samples, section sizes), rebuilds the section of
each claim from scratch in a temporary directory (no cached part of the report is reused; trained models come from
the poslens cache, as in the report) and prints, per claim, its verdict, key number and every test. The report's
rows name this command when no stock poslens command prints their number.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from poslens.errors import UsageError
from poslens.report.claims import Claim
from poslens.report.context import Context
from poslens.report.section import spec

_built: dict[tuple[str, str], dict[str, Claim]] = {}  # (run, section) -> claims, so one build serves many rows


def settings(run: Path) -> dict:
    """The reproduce run's run.json (a one-line error when `run` is not a reproduce report)."""
    try:
        meta = json.loads((run / "run.json").read_text())
    except (OSError, ValueError, RecursionError):
        raise UsageError(f"run: {run} is not a poslens reproduce report (no readable run.json)") from None
    if not isinstance(meta, dict):
        raise UsageError(f"run: {run}/run.json is not a JSON object; rerun `poslens reproduce`")
    if meta.get("kind") != "reproduce":
        raise UsageError(f"run: {run} is a {meta.get('kind')!r} run, not a reproduce report")
    cfg, metrics = meta.get("config"), meta.get("metrics")
    broken = ("config is not an object" if not isinstance(cfg, dict)
              else "metrics is not an object" if not isinstance(metrics, dict)
              else "metrics.claims is not a list of claims" if not isinstance(metrics.get("claims"), list)
              or not all(isinstance(c, dict) and isinstance(c.get("id"), str) and isinstance(c.get("section_name"), str)
                         for c in metrics["claims"])
              else "config has no samples, seed, quick and sizes" if not (
                  isinstance(cfg.get("samples"), int) and isinstance(cfg.get("seed"), int)
                  and isinstance(cfg.get("quick"), bool) and isinstance(cfg.get("sizes"), dict))
              else None)
    if broken:
        raise UsageError(f"run: {run}/run.json is not a complete reproduce report ({broken}); rerun `poslens "
                         "reproduce`")
    return meta


def remeasure(run: str | Path, claim_id: str, progress: bool = False) -> Claim:
    """Rebuild the section of `claim_id` with the settings of the report at `run`; returns the new claim."""
    run = Path(run).expanduser().absolute()
    meta = settings(run)
    rows = {c["id"]: c for c in meta["metrics"]["claims"]}
    if claim_id not in rows:
        raise UsageError(f"claim {claim_id!r} is not in {run}; its claims: {', '.join(rows)}")
    name = rows[claim_id]["section_name"]
    key = (str(run), name)
    if key not in _built:
        cfg = meta["config"]
        sizes = cfg["sizes"].get(name)
        if not isinstance(sizes, dict):
            raise UsageError(f"run: {run}/run.json has no sizes of section {name} (config.sizes); rerun `poslens "
                             "reproduce`")
        sizes = spec(name).size(cfg["quick"], sizes)  # checked as reproduce checks --sizes
        with tempfile.TemporaryDirectory(prefix="poslens-remeasure-") as tmp:
            ctx = Context(Path(tmp) / "report", run, Path(tmp) / "parts", cfg["samples"], cfg["seed"], cfg["quick"],
                          progress, draw=False)
            ctx.parts.mkdir(parents=True)
            section = spec(name).build(ctx, sizes)
        _built[key] = {c.id: c for c in section.claims}
    return _built[key][claim_id]


def describe(c: Claim) -> str:
    """The lines printed for one claim: id, verdict, key number, then one line per test."""
    lines = [f"{c.id}: {c.verdict}", f"  key: {c.key_number()}"]
    lines += [f"  {role}: {t.text()}" for role, t in c.all_tests()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m poslens.report.remeasure", description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a directory written by `poslens reproduce`")
    ap.add_argument("claims", nargs="+", metavar="ID", help="claim ids (the anchors of the report's rows)")
    ap.add_argument("--progress", action="store_true", help="show progress while rebuilding")
    a = ap.parse_args(argv)
    try:
        for cid in a.claims:
            print(describe(remeasure(a.run, cid, a.progress)), flush=True)
    except UsageError as err:
        print(f"remeasure: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
