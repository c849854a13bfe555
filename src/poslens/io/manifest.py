"""The manifest of a run directory: every file and folder poslens wrote into it, so that `--force` replaces a
run only when nothing else is in it.

A run directory carries ``poslens-manifest.json``, written when the run is placed (`write_manifest`, from what
is in its build directory): each path relative to the run, its type (file, dir, link) and, for a file, its
size and the SHA-256 of its content (computed while poslens wrote it where `poslens.io.writing` wrote it, else
read once here). `foreign` walks a directory and names the first entry that is not listed, has another type,
or (a file) another size or content: something of the user's, or a file the user changed, even by one byte
and without changing its size. A directory is replaceable when it is empty or `foreign` finds nothing.
(Manifests written before content hashes, format 1 without "sha256", are checked by size.)

Runs written by release 0.2 have no manifest. One counts as poslens's when its ``run.json`` says poslens wrote
it and every entry is one that 0.2's command of that kind wrote (`LEGACY`): ``run.json``,
``tensors.safetensors`` and PNG / PDF / JPEG files in ``figures/``, plus ``report.html``, ``report.md`` and
replaceable runs in ``models/`` for `reproduce`, and ``metrics.jsonl`` with the Hugging Face model and tokenizer
files for `train`. Anything else (a ``notes.txt``, a folder ``mydata/``, a ``figures/sub/``) makes it foreign.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path

from poslens.io.writing import file_sha256, write_text

NAME = "poslens-manifest.json"
FORMAT = 1
META = "run.json"
MARKER = "poslens_run"  # run.json field that says "poslens wrote this directory"

FIGURE = re.compile(r"[^/]+\.(png|pdf|jpg)")
HF_FILES = re.compile(r"config\.json|generation_config\.json|model\.safetensors|model\.safetensors\.index\.json|"
                      r"model-\d{5}-of-\d{5}\.safetensors|tokenizer\.json|tokenizer_config\.json|chat_template\.jinja|"
                      r"special_tokens_map\.json|added_tokens\.json|vocab\.json|merges\.txt")
# What release 0.2 wrote at the top of a run directory, by kind (every kind: run.json, tensors, figures/).
LEGACY = {"reproduce": re.compile(r"report\.html|report\.md"),
          "train": re.compile(rf"metrics\.jsonl|{HF_FILES.pattern}")}

# A rule for one entry of a walk (path relative to the run, "figures/a.png"; type; size of a file): None to accept
# it (and look inside a folder), CHECKED to accept it without looking inside, else why it is foreign.
Accept = Callable[[str, str, int | None], str | None]
CHECKED = ""


def _kind(st: os.stat_result) -> str:
    if stat.S_ISLNK(st.st_mode):
        return "link"
    return "dir" if stat.S_ISDIR(st.st_mode) else "file"


def entries(directory: str | os.PathLike) -> dict[str, dict]:
    """Every path under `directory` (links not followed), sorted: {relative path: {"type", "bytes", "sha256"}}."""
    out: dict[str, dict] = {}

    def visit(path: Path, rel: str) -> None:
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            name = f"{rel}{entry.name}"
            st = entry.stat(follow_symlinks=False)
            kind = _kind(st)
            out[name] = ({"type": kind, "bytes": st.st_size, "sha256": file_sha256(entry.path)} if kind == "file"
                         else {"type": kind})
            if kind == "dir":
                visit(Path(entry.path), f"{name}/")

    visit(Path(directory), "")
    return out


def write_manifest(directory: str | os.PathLike) -> None:
    """Record everything in `directory` in its manifest (the manifest lists itself, without a size)."""
    directory = Path(directory)
    listed = {k: v for k, v in entries(directory).items() if k != NAME}
    listed[NAME] = {"type": "file"}
    lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(listed.items()))
    text = f'{{"poslens_manifest": {FORMAT}, "entries": {{\n{lines}\n}}}}\n'  # one entry per line
    write_text(directory / NAME, text)


def read_manifest(directory: str | os.PathLike) -> dict[str, dict] | None:
    """The entries of `directory`'s manifest, or None when it has none (or not one poslens could have written)."""
    path = Path(directory) / NAME
    try:
        if not path.is_file() or path.is_symlink() or path.stat().st_size > 256 << 20:
            return None
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    listed = data.get("entries") if isinstance(data, dict) and data.get("poslens_manifest") == FORMAT else None
    if not isinstance(listed, dict):
        return None
    return listed if all(isinstance(v, dict) for v in listed.values()) else None


def run_meta(directory: str | os.PathLike) -> dict | None:
    """The run.json of `directory` when poslens wrote it (marker, or an older run with kind and
    environment.poslens), else None."""
    path = Path(directory) / META
    try:
        if not path.is_file() or path.stat().st_size > 64 << 20:
            return None
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(meta, dict):
        return None
    env = meta.get("environment")
    if meta.get(MARKER) == 1 or (isinstance(meta.get("kind"), str) and isinstance(env, dict) and "poslens" in env):
        return meta
    return None


def foreign(directory: str | os.PathLike, content: bool = True) -> str | None:
    """Why `directory` is not entirely poslens's, naming the first entry poslens did not write (or changed), or
    None when it is: empty, or every entry listed in its manifest (release 0.2: as `LEGACY` says). `content`:
    compare each file's SHA-256 too (False: names, types and sizes only, no file read)."""
    directory = Path(directory)
    listed = read_manifest(directory)
    if listed is not None:
        def accept(rel: str, kind: str, size: int | None) -> str | None:
            want = listed.get(rel)
            if rel == NAME and kind == "file":
                return None
            if want is None or want.get("type") != kind:
                return f"{directory / rel} was not written by poslens (it is not in the run's {NAME})"
            if kind == "file" and want.get("bytes") != size:
                return (f"{directory / rel} was changed after poslens wrote it ({size} bytes, written as "
                        f"{want.get('bytes')})")
            if content and kind == "file" and "sha256" in want and _sha256(directory / rel) != want["sha256"]:
                return (f"{directory / rel} was changed after poslens wrote it (its content differs from the "
                        f"SHA-256 in {NAME})")
            return None

        return _first(directory, "", accept)
    meta = run_meta(directory)
    if meta is None:
        return None if is_empty(directory) else f"{directory} has no {NAME} or poslens {META} (it may hold your files)"
    return _first(directory, "", _legacy(directory, meta))


def _sha256(path: Path) -> str | None:
    try:
        return file_sha256(path)
    except OSError:
        return None


def _legacy(directory: Path, meta: dict) -> Accept:
    """The entries release 0.2 wrote into a run of `meta`'s kind (it wrote no manifest)."""
    extra = LEGACY.get(meta.get("kind"))

    def accept(rel: str, kind: str, size: int | None) -> str | None:
        top = rel.count("/") == 0
        ok = ((kind == "file" and top and (rel in (META, "tensors.safetensors")
                                           or (extra is not None and extra.fullmatch(rel))))
              or (kind == "dir" and rel == "figures")
              or (kind == "file" and rel.startswith("figures/") and FIGURE.fullmatch(rel[len("figures/"):]))
              or (kind == "dir" and rel == "models" and meta.get("kind") == "reproduce"))
        if ok:
            return None
        if kind == "dir" and rel.startswith("models/") and rel.count("/") == 1 and meta.get("kind") == "reproduce":
            return foreign(directory / rel) or CHECKED  # a run of its own, checked by its own rules
        return (f"{directory / rel} is not a file poslens writes into a {meta.get('kind')!r} run (the run, written "
                f"before runs had a {NAME}, holds something else)")

    return accept


def _first(directory: Path, rel: str, accept: Accept) -> str | None:
    """The first reason `accept` gives for an entry under `directory` (sorted, top-down; a refused folder is
    named, not its contents), or None."""
    try:
        listing = sorted(os.scandir(directory / rel if rel else directory), key=lambda e: e.name)
    except OSError as e:
        return f"{directory / rel} cannot be read ({e.strerror})"
    for entry in listing:
        name = f"{rel}{entry.name}"
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError as e:
            return f"{directory / name} cannot be read ({e.strerror})"
        kind = _kind(st)
        why = accept(name, kind, st.st_size if kind == "file" else None)
        if why:
            return why
        if kind == "dir" and why is None:
            why = _first(directory, f"{name}/", accept)
            if why:
                return why
    return None


def is_empty(path: str | os.PathLike) -> bool:
    """An empty directory (one that cannot be listed counts as not empty)."""
    try:
        with os.scandir(path) as it:
            return next(it, None) is None
    except OSError:
        return False
