"""Exclusive locks on lock files, for run directories and for the shared cache.

A lock is a file ``.NAME.lock`` (``.NAME.cache.lock`` for a cache entry) beside what it guards, held with ``flock``
and holding its owner's pid. The kernel releases a ``flock`` when its process dies, so a killed holder never
blocks anyone; the holder removes the file when it lets go (a waiter that then gets the lock on the removed file
notices and takes the new one).
No lock file of size 0 outlives a failed acquisition: when the pid cannot be written (a full disk), the file
is removed and the failure is one line naming it. Without ``flock`` (not POSIX) the file is created with
``O_EXCL`` and a file whose pid is no longer running is taken over.

Run directories refuse a second run at once (`FileLock.acquire` without `wait`); a shared cache entry makes a
second process wait for the first (`cache_lock`), printing one line that says so.
"""

from __future__ import annotations

import errno
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from poslens.errors import UsageError
from poslens.io.protect import building
from poslens.io.space import disk_space

try:
    import fcntl
except ImportError:  # not POSIX
    fcntl = None

SUFFIX = ".lock"
CACHE_SUFFIX = ".cache.lock"  # its own file: a cache entry that is a run directory has both locks
CACHE_FIX = "point POSLENS_CACHE at a writable directory"


def lock_path(target: str | os.PathLike, suffix: str = SUFFIX) -> Path:
    """The lock file of `target`: ``PARENT/.NAME.lock`` (``.NAME.cache.lock`` for a cache entry)."""
    target = Path(target)
    return target.parent / f".{target.name}{suffix}"


class FileLock:
    """An exclusive lock on the file `path`; `fix` ends the message when the file cannot be created."""

    def __init__(self, path: Path, fix: str):
        self.path, self.fix, self.fd = Path(path), fix, None

    def acquire(self, wait: Callable[[int | None], None] | None = None) -> bool:
        """Take the lock. When another process holds it: without `wait`, return False at once; with `wait`,
        call `wait(pid of the holder)` once and block until the lock is free."""
        told = False
        for _ in range(1000):  # each turn: the file was removed by its last holder between our open and lock
            fd = self._open()
            if fd is None:  # not POSIX: a live holder's file exists
                if wait is None:
                    return False
                if not told:
                    wait(self._pid_of_holder())
                    told = True
                time.sleep(0.5)
                continue
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if wait is None:
                        os.close(fd)
                        return False
                    if not told:
                        wait(self._pid_of_holder())
                        told = True
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX)
                    except BaseException:
                        os.close(fd)
                        raise
            if _same_file(self.path, fd):
                self.fd = fd
                self._write_pid()
                return True
            os.close(fd)
        raise UsageError(f"lock file {self.path} keeps changing under this process; {self.fix}")

    def _open(self) -> int | None:
        flags = os.O_RDWR | os.O_CREAT | (os.O_EXCL if fcntl is None else 0)
        try:
            with disk_space(self.path, 64):
                return os.open(self.path, flags, 0o666)
        except FileExistsError:  # not POSIX only
            if alive(_read_pid(self.path)):
                return None
            self.path.unlink(missing_ok=True)  # its owner died
            return self._open()
        except UsageError:
            raise
        except OSError as e:
            raise UsageError(f"cannot create lock file {self.path}: {e.strerror}; {self.fix}") from None

    def _pid_of_holder(self) -> int | None:
        """The pid in the lock file (the holder writes it right after taking the lock), or None."""
        for _ in range(10):
            pid = _read_pid(self.path)
            if pid is not None:
                return pid
            time.sleep(0.02)
        return None

    def _write_pid(self) -> None:
        text = f"{os.getpid()}\n".encode()
        try:
            with disk_space(self.path, len(text)):
                os.ftruncate(self.fd, 0)
                if os.write(self.fd, text) != len(text):
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        except BaseException:
            self.release()  # removes the file: no empty lock file stays behind
            raise

    def release(self) -> None:
        """Let go: remove the file (while still holding it) and close it."""
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = None


def _same_file(path: Path, fd: int) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int | None) -> bool:
    """Whether process `pid` exists (unknown pid: assume alive, never take over on a guess)."""
    if pid is None or pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


@contextmanager
def cache_lock(path: str | os.PathLike, what: str, entry: str | os.PathLike | None = None) -> Iterator[None]:
    """Hold the lock of the shared cache entry `path` (``.NAME.cache.lock`` beside it) for the block.

    A second process waits, printing one line ("waiting for another poslens process (pid N) to finish building
    WHAT"), then runs its block: check there for the finished entry before building it. The entry's directory
    is created; one that cannot be written is refused in one line before any work. The block may write the
    entry (`entry`, default `path`) as a run directory (`poslens.io.rundir.run_directory(path, force=True)`: a
    run's lock is another file): inside the block it is the one output allowed inside the cache
    (`poslens.io.protect`). Folders created for the entry are removed again if the block leaves them empty (a
    build that failed on a full disk leaves no empty ``trained/`` behind).
    """
    path = Path(path)
    created = []
    parent = path.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        created.append(parent)
        parent = parent.parent
    try:
        with disk_space(path.parent, 4096):
            path.parent.mkdir(parents=True, exist_ok=True)
    except UsageError:
        raise
    except OSError as e:
        raise UsageError(f"cache directory {path.parent} cannot be created: {e.strerror}; {CACHE_FIX}") from None
    try:
        with _locked(path, what), building(path if entry is None else entry):
            yield
    finally:
        for p in created:  # deepest first; rmdir removes only an empty folder
            try:
                p.rmdir()
            except OSError:
                break


@contextmanager
def _locked(path: Path, what: str) -> Iterator[None]:
    """The cache lock of `path`, waited for (one line says so)."""

    def waiting(pid: int | None) -> None:
        who = f" (pid {pid})" if pid is not None else ""
        print(f"waiting for another poslens process{who} to finish building {what}", file=sys.stderr, flush=True)

    lock = FileLock(lock_path(path, CACHE_SUFFIX), CACHE_FIX)
    lock.acquire(wait=waiting)
    try:
        yield
    finally:
        lock.release()


@contextmanager
def entry_lock(path: Path, what: str) -> Iterator[None]:
    """Hold the cache lock of entry `path` while it is checked and built: a second process waits (one line says
    so), then finds the entry complete. The lock file is ``.NAME.cache.lock``, apart from the run lock
    ``.NAME.lock`` that writing the entry takes."""
    with cache_lock(path, what, entry=path):  # (before 2026-11-30 the file was named .NAME.cache.cache.lock)
        yield
