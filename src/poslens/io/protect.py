"""What a run may never write over: its inputs and the poslens cache.

`check_not_input(out, inputs)` refuses an output directory that is one of the run's inputs (a model, a token
directory, a preset or matrix file, a compared run, --data), contains one or lies inside one, after resolving
links, with or without --force; and one that is the poslens cache, contains it, or lies inside it
(``$POSLENS_CACHE``, else ``~/.cache/poslens``: the converted models, trained models, token directories and
corpus every command reads).
Only the cache's own builders write there: the code that builds a cache entry holds its cache lock
(`poslens.io.lock.cache_lock`), which names the entry as the one output allowed inside the cache (`building`).

The same rule serves every command: `poslens.io.rundir` calls it for every run directory it opens.
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from poslens.errors import UsageError

__all__ = ["building", "cache_root", "check_not_input", "inside_cache"]

_BUILDING: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("poslens_cache_entry", default=())


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The poslens cache: `cache_dir`, else $POSLENS_CACHE, else ~/.cache/poslens."""
    root = cache_dir or os.environ.get("POSLENS_CACHE") or Path.home() / ".cache" / "poslens"
    return Path(root).expanduser()


@contextmanager
def building(entry: str | os.PathLike) -> Iterator[None]:
    """Inside the block, cache entry `entry` may be written as an output (its builder holds its cache lock)."""
    token = _BUILDING.set((*_BUILDING.get(), os.path.realpath(entry)))
    try:
        yield
    finally:
        _BUILDING.reset(token)


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def inside_cache(out: str | os.PathLike) -> str | None:
    """Why output `out` would write over the poslens cache (it is the cache, holds it, or lies inside it and is not
    an entry being built by its builder), or None."""
    real, root = _real(out), _real(cache_root())
    if str(real) in _BUILDING.get():
        return None
    if real == root or real in root.parents:
        return f"{'is' if real == root else 'contains'} the poslens cache {root}"
    if root in real.parents:
        return (f"is inside the poslens cache {root} (its converted models, trained models, token directories and "
                "corpus are poslens's own: every command reads them)")
    return None


def check_not_input(out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None]) -> None:
    """Refuse output `out` when it is one of `inputs`, contains one or lies inside one (links resolved; an input that
    does not exist, or None, has nothing to protect), or when it would write over the poslens cache (see the module
    docstring)."""
    real = _real(out)
    for given in inputs:
        if given is None or not os.path.lexists(os.path.expanduser(os.fspath(given))):
            continue
        p = _real(given)
        if real == p or real in p.parents or p in real.parents:
            how = "is" if real == p else "contains" if real in p.parents else "is inside"
            raise UsageError(f"--out {out} {how} this run's input {given}; a run never writes over what it reads, "
                             "choose another --out")
    why = inside_cache(out)
    if why:
        raise UsageError(f"--out {out} {why}; a run never writes over what it reads, choose another --out")
