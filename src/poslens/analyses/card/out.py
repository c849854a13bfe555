"""What `poslens card` may write into: a new or empty --out, or a card directory, which holds what a card writes
and nothing else (docs/card.md, "Resume"):

    OUT/card/                          the page: a run directory of kind "card"
    OUT/MODEL/scores, leakage,         the sub-runs of each model: run directories of `poslens scores`, `leakage`,
              probe, length            `stat` and `length`

besides poslens's work files of these (`.card.lock`, `.scores.partial/`, ...: `poslens.io.rundir`). Anything else
(a folder of the user's, a run of another command) is refused in one line, with or without --force, before anything
is written: --force has one meaning everywhere, it replaces only what poslens wrote. What a call replaces (the page,
every time; a sub-run it measures again) must hold nothing poslens did not write (`replaced_by_another`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from poslens.errors import UsageError
from poslens.io.manifest import foreign, run_meta

PAGE = "card"
KINDS = {"scores": "scores", "leakage": "leakage", "probe": "stat", "length": "length"}  # sub-run -> its kind
WORK = re.compile(r"\.(?P<name>.+?)\.(lock|partial|tmp-|old-)")  # rundir's work files beside a run NAME


def check_card_out(out: Path) -> None:
    """Refuse an --out that is neither new, empty nor a card directory (module docstring), in one line."""
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_dir():
        raise UsageError(f"out: {out} is not a directory; choose another --out", param="out")
    meta = run_meta(out)
    why = f"it is a poslens {meta.get('kind')} run" if meta is not None else not_a_card(out)
    if why:
        raise UsageError(f"out: {out} is not a card directory ({why}); a card writes only into a new directory or "
                         "a card's, with or without --force: choose another --out", param="out")


def not_a_card(out: Path) -> str | None:
    """The first entry of `out` that a card does not write, or something of the user's in its page; None if none."""
    for entry in sorted(out.iterdir()):
        if _work_file(entry, {PAGE}):
            continue
        why = (_run_of(entry, "card") or foreign(entry)) if entry.name == PAGE else _model_folder(entry)
        if why:
            return why
    return None


def replaced_by_another(path: Path) -> str | None:
    """Why the run at `path`, which this call replaces, holds something poslens did not write (None: it does not,
    or there is nothing there)."""
    return foreign(path) if os.path.lexists(path) else None


def _model_folder(folder: Path) -> str | None:
    if folder.is_symlink() or not folder.is_dir():
        return f"{folder} is not a model's folder of sub-runs"
    for entry in sorted(folder.iterdir()):
        if _work_file(entry, set(KINDS)):
            continue
        if entry.name not in KINDS:
            return f"{entry} is not one of a card's sub-runs ({', '.join(KINDS)})"
        why = _run_of(entry, KINDS[entry.name])
        if why:
            return why
    return None


def _run_of(path: Path, kind: str) -> str | None:
    meta = None if path.is_symlink() or not path.is_dir() else run_meta(path)
    return None if meta is not None and meta.get("kind") == kind else f"{path} is not a poslens {kind} run"


def _work_file(entry: Path, names: set[str]) -> bool:
    match = WORK.match(entry.name)
    return match is not None and match.group("name") in names
