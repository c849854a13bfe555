"""Run directories that cannot destroy user data: checked, locked, built aside, placed without replacing.

For an output directory ``PARENT/NAME`` a run uses, beside it:

    PARENT/.NAME.lock       lock file, held (``flock``) for the run's life; the kernel drops it when the
                            process dies, so a killed run never blocks the next one. Removed at the end.
    PARENT/.NAME.partial/   the work directory of NAME, stable from one attempt to the next:
        build/              the run being written; renamed to NAME when complete
        old/                an earlier run being replaced, for the instant of the swap
        *.safetensors       checkpoints (`RunDir.checkpoint`): kept when a run fails or is interrupted, so
                            the next run of the same output resumes from them; removed when the run completes

Guarantees:

* A run records what it wrote: ``poslens-manifest.json`` lists every file and folder of the build when it is
  placed (`poslens.io.manifest`). ``force`` replaces only an empty directory or one whose every entry is in
  its manifest, with the size and content (SHA-256) it was written with (a run of release 0.2, which wrote no
  manifest: only the files 0.2 wrote, see `poslens.io.manifest.LEGACY`); never the current directory, a parent
  of it, the home directory or ``/``, a symbolic link or a file. A refusal names the first foreign entry.
* A run never writes over its inputs: an output equal to one of `inputs` or containing one (compared after
  resolving links) is refused, with or without ``force``; so is one that is, holds or lies inside the poslens
  cache, whose entries every command reads (`poslens.io.protect`), unless it is the cache entry being built.
* Two runs with the same output at once: the second is refused (one-line `UsageError`) while the first
  holds the lock. The final placement is a no-replace rename (``renameat2(RENAME_NOREPLACE)`` on Linux;
  elsewhere ``rename``, which can only replace an empty directory), so whatever appeared at NAME during
  the run is never replaced without ``force``, and with ``force`` only if poslens wrote all of it.
* Temporaries live in ``.NAME.partial/build`` and are removed on every exit Python sees; what a killed
  run leaves (``build/``, ``old/``, ``*.tmp-*`` files, the older layout's ``.NAME.tmp-*`` and
  ``.NAME.old-*``) is cleaned by the next run of the same output, and a run killed in the middle of a swap
  gets its previous result back. Parent directories created for a run that then fails are removed if empty.
  A full disk is one line naming the file and the bytes it needed (`poslens.io.space`).
* Directories and files get the user's umask permissions (safetensors alone writes 0600).

Use `open_run` for a run that checkpoints (training, long Monte Carlo), `run_directory` for a plain one:

    with open_run("runs/train", force=False, inputs=[data_dir]) as run:   # run.build: write here
        ...                                                                # run.checkpoint("state")
"""

from __future__ import annotations

import atexit
import contextvars
import ctypes
import errno
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from poslens.errors import UsageError
from poslens.io.lock import FileLock, alive, lock_path
from poslens.io.manifest import MARKER, META, foreign, is_empty, write_manifest
from poslens.io.protect import check_not_input
from poslens.io.space import disk_space

__all__ = ["MARKER", "META", "RunDir", "check_output", "current_run", "open_run", "remove_empty_parents",
           "run_directory", "share", "share_tree", "sharded_run_directory", "stale_tmp", "umask_mode"]

WORK_SUFFIX = ".partial"
NAME_MARGIN = 48  # characters poslens adds to NAME for its work files (".NAME.partial-0-of-1.safetensors.tmp-PID")


@dataclass
class RunDir:
    """An output directory being built: write into `build`; checkpoints go to `checkpoint(name)`."""

    path: Path  # where the finished run goes
    work: Path  # .NAME.partial: survives an interrupted run
    force: bool = False

    @property
    def build(self) -> Path:
        """The directory being written; it becomes `path` when the run completes."""
        return self.work / "build"

    def checkpoint(self, name: str) -> Path:
        """A checkpoint file in the work directory: kept if the run stops, removed when it completes."""
        return self.work / f"{name}.safetensors"


_ACTIVE: contextvars.ContextVar[RunDir | None] = contextvars.ContextVar("poslens_run", default=None)
_CREATED: list[Path] = []  # parent directories this process created for runs, deepest last


def current_run() -> RunDir | None:
    """The run directory being built around the caller (inside `open_run` / `run_directory`), if any."""
    return _ACTIVE.get()


# ---------------------------------------------------------------- what may be replaced


def _protected(path: Path) -> str | None:
    """Why `path` may never be an output directory (cwd, a parent of it, home, /), or None."""
    real = Path(os.path.realpath(path))
    cwd = Path(os.path.realpath(os.getcwd()))
    if real == Path(real.anchor):
        return "it is the root directory"
    if real == cwd:
        return "it is the current directory"
    if real in cwd.parents:
        return "it is a parent of the current directory"
    home = os.path.expanduser("~")
    if home != "~" and real == Path(os.path.realpath(home)):
        return "it is the home directory"
    return None


def _resolve(path: str | os.PathLike) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise UsageError(f"--out must be a path, got {type(path).__name__}")
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if not text.strip():
        raise UsageError("--out is empty; name a directory for the results")
    if "\x00" in text:
        raise UsageError("--out contains a NUL character; choose another --out")
    return Path(os.path.abspath(os.path.expanduser(text)))


def _name_limit(parent: Path) -> int:
    probe = parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


def _check(path: Path, force: bool, inputs: Iterable[str | os.PathLike] = ()) -> None:
    """Everything about `path` that can be checked without writing (see the module docstring)."""
    why = _protected(path)
    if why:
        raise UsageError(f"--out {path}: {why}; poslens never writes over it, choose a new directory")
    check_not_input(path, inputs)
    limit = _name_limit(path.parent) - NAME_MARGIN
    if len(os.fsencode(path.name)) > limit:
        raise UsageError(f"--out name is {len(os.fsencode(path.name))} bytes long; at most {limit} fit here "
                         f"(poslens adds up to {NAME_MARGIN} for its work files), choose a shorter --out")
    if os.path.islink(path):
        raise UsageError(f"--out {path} is a symbolic link; poslens does not write through links, choose "
                         "another --out")
    if os.path.lexists(path):
        if not path.is_dir():
            raise UsageError(f"output path {path} exists and is not a directory; choose another --out")
        if not force:
            why = foreign(path, content=False)  # --force would refuse it: not worth suggesting
            if why:
                raise UsageError(f"output directory {path} already exists and {why}; choose another --out (poslens "
                                 "replaces only a run directory it wrote, and deletes nothing of yours)")
            raise UsageError(f"output directory {path} already exists; pass --force to overwrite or choose "
                             "another --out")
        why = foreign(path)
        if why:
            raise UsageError(f"--force replaces only a run directory written by poslens, and {why}; choose another "
                             "--out (poslens deletes nothing of yours)")
    ancestor = path.parent
    while not os.path.lexists(ancestor) and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UsageError(f"cannot create output directory {path}: {ancestor} is not a directory; choose "
                         "another --out")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UsageError(f"output directory {ancestor} is not writable; choose a writable --out")


def _make_parents(path: Path) -> None:
    """Create the missing parents of `path`, remembering them so that a failed run can remove them."""
    missing = []
    p = path.parent
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    for p in reversed(missing):
        try:
            p.mkdir()
        except FileExistsError:
            continue
        except OSError as e:
            raise UsageError(f"cannot create output directory {p}: {e.strerror}; choose a writable --out") from None
        _CREATED.append(p)


def remove_empty_parents() -> None:
    """Remove the parent directories this process created for runs, if they are (still) empty."""
    while _CREATED:
        try:
            _CREATED.pop().rmdir()  # deepest first; rmdir removes only an empty directory
        except OSError:
            pass


atexit.register(remove_empty_parents)


# ---------------------------------------------------------------- leftovers


def _tmp_pid(name: str) -> int | None:
    """The pid in a `*.tmp-PID` file name (poslens checkpoint temporaries), or None."""
    tail = name.rsplit(".tmp-", 1)
    return int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else None


def stale_tmp(path: Path) -> bool:
    """A `*.tmp-PID` file whose writer is gone."""
    pid = _tmp_pid(path.name)
    return pid is not None and not alive(pid)


def _restore_or_remove(old: Path, target: Path) -> None:
    """A replaced run left by a kill mid-swap: put it back if nothing took its place, else discard it."""
    if not os.path.lexists(target):
        os.rename(old, target)
    else:
        _discard(old, target)


def _discard(old: Path, target: Path) -> None:
    """Delete the replaced run of `target`, unless something poslens did not write got into it during the swap:
    then it is moved beside `target` as NAME.replaced-TIME-PID and one line says so."""
    why = foreign(old)
    if not why:
        shutil.rmtree(old, ignore_errors=True)
        return
    kept = target.with_name(f"{target.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
    _rename_noreplace(old, kept)
    print(f"poslens: the run replaced at {target} held something else ({why}); it was kept as {kept}",
          file=sys.stderr, flush=True)


def clean_leftovers(target: Path) -> None:
    """Remove what killed runs of `target` left beside it (call with the lock held)."""
    parent, name = target.parent, target.name
    if not parent.is_dir():
        return
    work = parent / f".{name}{WORK_SUFFIX}"
    if work.is_dir() and not work.is_symlink():
        shutil.rmtree(work / "build", ignore_errors=True)
        if (work / "old").exists():
            _restore_or_remove(work / "old", target)
        for p in work.iterdir():
            if ".tmp-" in p.name and p.is_file():
                p.unlink(missing_ok=True)
        if is_empty(work):  # no checkpoint to resume from
            work.rmdir()
    for p in parent.glob(f".{_glob_escape(name)}.*"):
        rest = p.name[len(name) + 2:]
        if rest.startswith("tmp-") and p.is_dir():  # the older layout's build directory
            shutil.rmtree(p, ignore_errors=True)
        elif rest.startswith("old-") and p.is_dir():  # the older layout's replaced run
            _restore_or_remove(p, target)
        elif p.is_file() and stale_tmp(p):  # checkpoint temporaries (scores' .NAME.partial-R-of-W...tmp-PID)
            p.unlink(missing_ok=True)
    parts = parent / f".{name}.parts"  # reproduce's cache: half-written entries
    if parts.is_dir():
        for p in parts.glob("*.tmp"):
            p.unlink(missing_ok=True)


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)


# ---------------------------------------------------------------- placement


def _rename_noreplace(src: Path, dst: Path) -> None:
    """Rename src to dst, failing with FileExistsError if dst exists (atomically where the OS allows)."""
    if sys.platform == "linux":
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            renameat2 = libc.renameat2
        except (OSError, AttributeError):
            renameat2 = None
        if renameat2 is not None:
            at_fdcwd, noreplace = -100, 1
            if renameat2(at_fdcwd, os.fsencode(src), at_fdcwd, os.fsencode(dst), noreplace) == 0:
                return
            err = ctypes.get_errno()
            if err == errno.EEXIST:
                raise FileExistsError(err, os.strerror(err), str(dst))
            if err not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
                raise OSError(err, os.strerror(err), str(dst))
    if os.path.lexists(dst):
        raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)  # a directory can replace only an empty directory: never loses a file


def _place(run: RunDir) -> None:
    """Move the finished build to run.path; with force, swap out a poslens run that is there."""
    target, old = run.path, run.work / "old"
    moved = False
    if os.path.lexists(target):
        if not run.force:
            raise UsageError(f"{target} appeared while this run was working and was left as it is; rerun with "
                             "another --out (or --force if poslens wrote it)")
        why = "it is not a directory" if os.path.islink(target) or not target.is_dir() else foreign(target)
        if not why:
            os.rename(target, old)
            moved = True
            why = foreign(old)  # checked again once moved aside: nothing can be added to it unseen any more
            if why:
                os.rename(old, target)
        if why:
            raise UsageError(f"{target} was changed while this run was working by something poslens did not write "
                             f"({why}); it was left as it is, rerun with another --out")
    share_tree(run.build)  # files a library wrote 0600 (a trained model's weights) get the umask's permissions
    try:
        _rename_noreplace(run.build, target)
    except OSError as e:
        if moved and not os.path.lexists(target):
            os.rename(old, target)
        if isinstance(e, FileExistsError) or e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise UsageError(f"{target} appeared while this run was working and was left as it is; rerun with "
                             "another --out") from None
        raise UsageError(f"cannot move the finished run to {target}: {e.strerror}; choose another --out") from None
    if moved:
        _discard(old, target)


# ---------------------------------------------------------------- public API


def _lock(target: Path) -> FileLock:
    """The lock of output `target`, taken; a one-line UsageError when another run holds it."""
    lock = FileLock(lock_path(target), fix="choose a writable --out")
    if not lock.acquire():
        raise UsageError(f"another poslens run is writing {target} right now (it holds {lock.path}); wait for it to "
                         "finish or choose another --out")
    return lock


def check_output(path: str | os.PathLike, force: bool = False, inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """Fail fast (before any compute) if `path` cannot become a run directory; returns it absolute.

    `inputs`: files and directories the run reads; an output equal to one or containing one is refused. Cleans
    what killed runs of the same output left, and creates missing parent directories (removed again at exit
    if the run leaves them empty).
    """
    inputs = list(inputs)
    target = _resolve(path)
    _check(target, force, inputs)
    _make_parents(target)
    lock = _lock(target)
    try:
        clean_leftovers(target)
        _check(target, force, inputs)
    finally:
        lock.release()
    return target


@contextmanager
def open_run(path: str | os.PathLike, force: bool = False,
             inputs: Iterable[str | os.PathLike] = ()) -> Iterator[RunDir]:
    """Build a run directory that can be resumed: yields a `RunDir` whose `build` becomes `path` on success.

    `inputs`: files and directories the run reads (model directory, data, compared runs); an output equal to
    one or containing one is refused, with or without `force`. The lock is held throughout: enter this before
    loading anything. On success the build gets its manifest and is placed. On any error (or interrupt) the
    build is removed, checkpoints stay in `work` for the next attempt, and parents created for this run are
    removed if empty.
    """
    inputs = list(inputs)
    target = _resolve(path)
    _check(target, force, inputs)
    _make_parents(target)
    lock = _lock(target)
    run = RunDir(path=target, work=target.parent / f".{target.name}{WORK_SUFFIX}", force=force)
    try:
        clean_leftovers(target)
        _check(target, force, inputs)
        if os.path.islink(run.work) or (os.path.lexists(run.work) and not run.work.is_dir()):
            raise UsageError(f"{run.work} is not a poslens work directory; move it away or choose another --out")
        with disk_space(run.build, 8192):
            run.work.mkdir(exist_ok=True)
            run.build.mkdir()
        token = _ACTIVE.set(run)
        try:
            yield run
        finally:
            _ACTIVE.reset(token)
        write_manifest(run.build)
        _place(run)
        shutil.rmtree(run.work, ignore_errors=True)
    except BaseException:
        shutil.rmtree(run.build, ignore_errors=True)
        try:
            run.work.rmdir()  # only if no checkpoint is in it
        except OSError:
            pass
        lock.release()
        remove_empty_parents()
        raise
    finally:
        lock.release()


@contextmanager
def run_directory(path: str | os.PathLike, force: bool = False,
                  inputs: Iterable[str | os.PathLike] = ()) -> Iterator[Path]:
    """Yield the directory to write a run into; on success it becomes `path`, on any error it is removed
    (`inputs`: as `open_run`)."""
    with open_run(path, force, inputs) as run:
        yield run.build


@contextmanager
def sharded_run_directory(path: str | os.PathLike, force: bool, rank: int, world: int, partial: Path,
                          inputs: Iterable[str | os.PathLike] = ()) -> Iterator[Path | None]:
    """The end of a run sharded over `world` ranks: rank 0 gets the directory to write (as `run_directory`), the
    others None; then every rank waits for rank 0 and removes its own partial-sums file `partial`."""
    if rank == 0:
        with run_directory(path, force, inputs) as tmp:
            yield tmp
    else:
        yield None
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
    partial.unlink(missing_ok=True)


def umask_mode(mode: int = 0o666) -> int:
    """`mode` under the process umask (what open() would give a new file)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return mode & ~int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mode & ~mask


def share(path: str | os.PathLike) -> None:
    """Give a file written by a library that creates 0600 files (safetensors) the umask's permissions."""
    try:
        os.chmod(path, umask_mode())
    except OSError:
        pass


def share_tree(path: str | os.PathLike) -> None:
    """`share` every file under the directory `path` whose permissions are not the umask's (a model's weights, as
    transformers' save_pretrained writes them through safetensors: 0600 whatever the umask)."""
    mode = umask_mode()
    for root, _, files in os.walk(path):
        for name in files:
            f = os.path.join(root, name)
            if not os.path.islink(f) and (os.stat(f).st_mode & 0o777) != mode:
                share(f)
