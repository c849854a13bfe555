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

* ``force`` replaces only a directory poslens wrote (its ``run.json`` has ``"poslens_run": 1``, or is an
  older poslens run with ``kind`` and ``environment.poslens``) or an empty directory; never the current
  directory, a parent of it, the home directory or ``/``, a symbolic link or a file.
* Two runs with the same output at once: the second is refused (one-line `UsageError`) while the first
  holds the lock. The final placement is a no-replace rename (``renameat2(RENAME_NOREPLACE)`` on Linux;
  elsewhere ``rename``, which can only replace an empty directory), so whatever appeared at NAME during
  the run is never replaced without ``force``, and with ``force`` only if poslens wrote it.
* Temporaries live in ``.NAME.partial/build`` and are removed on every exit Python sees; what a killed
  run leaves (``build/``, ``old/``, ``*.tmp-*`` files, the older layout's ``.NAME.tmp-*`` and
  ``.NAME.old-*``) is cleaned by the next run of the same output, and a run killed in the middle of a swap
  gets its previous result back. Parent directories created for a run that then fails are removed if empty.
* Directories and files get the user's umask permissions (safetensors alone writes 0600).

Use `open_run` for a run that checkpoints (training, long Monte Carlo), `run_directory` for a plain one:

    with open_run("runs/train", force=False) as run:   # run.build: write here; run.checkpoint("state")
        ...
"""

from __future__ import annotations

import atexit
import contextvars
import ctypes
import errno
import json
import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from poslens.errors import UsageError

try:
    import fcntl
except ImportError:  # not POSIX: an O_EXCL lock file with the owner's pid
    fcntl = None

MARKER = "poslens_run"  # run.json field that says "poslens wrote this directory"
META = "run.json"
WORK_SUFFIX = ".partial"
LOCK_SUFFIX = ".lock"
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


def is_poslens_run(path: str | os.PathLike) -> bool:
    """True when `path` is a directory holding a run.json that poslens wrote."""
    meta_path = Path(path) / META
    try:
        if not meta_path.is_file() or meta_path.stat().st_size > 64 << 20:
            return False
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return False
    if not isinstance(meta, dict):
        return False
    if meta.get(MARKER) == 1:
        return True
    env = meta.get("environment")  # runs written before the marker existed
    return isinstance(meta.get("kind"), str) and isinstance(env, dict) and "poslens" in env


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


def _empty(path: Path) -> bool:
    """An empty directory (one that cannot be listed counts as not empty)."""
    try:
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except OSError:
        return False


def _name_limit(parent: Path) -> int:
    probe = parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return os.pathconf(probe, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


def _check(path: Path, force: bool) -> None:
    """Everything about `path` that can be checked without writing (see the module docstring)."""
    why = _protected(path)
    if why:
        raise UsageError(f"--out {path}: {why}; poslens never writes over it, choose a new directory")
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
            raise UsageError(f"output directory {path} already exists; pass --force to overwrite or choose "
                             "another --out")
        if not is_poslens_run(path) and not _empty(path):
            raise UsageError(f"--force replaces only a run directory written by poslens, and {path} has no "
                             f"poslens {META} (it may hold your files); choose another --out or remove it yourself")
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


# ---------------------------------------------------------------- lock


class _Lock:
    """An exclusive lock on `.NAME.lock` beside the output (flock; O_EXCL + pid where there is no flock)."""

    def __init__(self, target: Path):
        self.target, self.path, self.fd = target, target.parent / f".{target.name}{LOCK_SUFFIX}", None

    def _busy(self) -> UsageError:
        return UsageError(f"another poslens run is writing {self.target} right now (it holds {self.path}); wait "
                          "for it to finish or choose another --out")

    def acquire(self) -> _Lock:
        for _ in range(20):
            if fcntl is None:
                if self._acquire_excl():
                    return self
                continue
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            except OSError as e:
                raise UsageError(f"cannot create lock file {self.path}: {e.strerror}; choose a writable --out") \
                    from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise self._busy() from None
            try:  # the file may have been unlinked by its last holder between our open and flock
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
                return self
            os.close(fd)
        raise self._busy()

    def _acquire_excl(self) -> bool:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            if _alive(_read_pid(self.path)):
                raise self._busy() from None
            self.path.unlink(missing_ok=True)  # its owner died
            return False
        os.write(fd, f"{os.getpid()}\n".encode())
        self.fd = fd
        return True

    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)  # while still held: a waiter re-checks the inode and retries
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None

    def __enter__(self) -> _Lock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _alive(pid: int | None) -> bool:
    """Whether process `pid` exists (unknown pid: assume alive, never delete on a guess)."""
    if pid is None:
        return True
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


# ---------------------------------------------------------------- leftovers


def _tmp_pid(name: str) -> int | None:
    """The pid in a `*.tmp-PID` file name (poslens checkpoint temporaries), or None."""
    tail = name.rsplit(".tmp-", 1)
    return int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else None


def stale_tmp(path: Path) -> bool:
    """A `*.tmp-PID` file whose writer is gone."""
    pid = _tmp_pid(path.name)
    return pid is not None and not _alive(pid)


def _restore_or_remove(old: Path, target: Path) -> None:
    """A replaced run left by a kill mid-swap: put it back if nothing took its place, else delete it."""
    if not os.path.lexists(target) and is_poslens_run(old):
        os.rename(old, target)
    else:
        shutil.rmtree(old, ignore_errors=True)


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
        if _empty(work):  # no checkpoint to resume from
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
        if os.path.islink(target) or not target.is_dir() or not (is_poslens_run(target) or _empty(target)):
            raise UsageError(f"{target} was replaced while this run was working by something poslens did not "
                             "write; it was left as it is, rerun with another --out")
        os.rename(target, old)
        moved = True
    try:
        _rename_noreplace(run.build, target)
    except OSError as e:
        if moved and not os.path.lexists(target):
            os.rename(old, target)
        if isinstance(e, FileExistsError) or e.errno in (errno.EEXIST, errno.ENOTEMPTY):
            raise UsageError(f"{target} appeared while this run was working and was left as it is; rerun with "
                             "another --out") from None
        raise UsageError(f"cannot move the finished run to {target}: {e.strerror}; choose another --out") from None


# ---------------------------------------------------------------- public API


def check_output(path: str | os.PathLike, force: bool = False) -> Path:
    """Fail fast (before any compute) if `path` cannot become a run directory; returns it absolute.

    Cleans what killed runs of the same output left, and creates missing parent directories (removed
    again at exit if the run leaves them empty).
    """
    target = _resolve(path)
    _check(target, force)
    _make_parents(target)
    with _Lock(target):
        clean_leftovers(target)
        _check(target, force)
    return target


@contextmanager
def open_run(path: str | os.PathLike, force: bool = False) -> Iterator[RunDir]:
    """Build a run directory that can be resumed: yields a `RunDir` whose `build` becomes `path` on success.

    The lock is held throughout. On any error (or interrupt) the build is removed, checkpoints stay in
    `work` for the next attempt, and parents created for this run are removed if empty.
    """
    target = _resolve(path)
    _check(target, force)
    _make_parents(target)
    lock = _Lock(target).acquire()
    run = RunDir(path=target, work=target.parent / f".{target.name}{WORK_SUFFIX}", force=force)
    try:
        clean_leftovers(target)
        _check(target, force)
        if os.path.islink(run.work) or (os.path.lexists(run.work) and not run.work.is_dir()):
            raise UsageError(f"{run.work} is not a poslens work directory; move it away or choose another --out")
        run.work.mkdir(exist_ok=True)
        run.build.mkdir()
        token = _ACTIVE.set(run)
        try:
            yield run
        finally:
            _ACTIVE.reset(token)
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
def run_directory(path: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield the directory to write a run into; on success it becomes `path`, on any error it is removed."""
    with open_run(path, force) as run:
        yield run.build


@contextmanager
def sharded_run_directory(path: str | os.PathLike, force: bool, rank: int, world: int,
                          partial: Path) -> Iterator[Path | None]:
    """The end of a run sharded over `world` ranks: rank 0 gets the directory to write (as `run_directory`), the
    others None; then every rank waits for rank 0 and removes its own partial-sums file `partial`."""
    if rank == 0:
        with run_directory(path, force) as tmp:
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
