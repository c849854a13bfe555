"""A full disk as one line: `disk_space` turns the failure of a write into a `UsageError` naming the path and
the bytes it needed.

Writers report a full disk in three ways: Python and the OS raise ``OSError`` with ``ENOSPC`` (or ``EDQUOT``,
over a quota); safetensors raises ``SafetensorError('... I/O error: No space left on device (os error 28)')``;
``torch.save`` raises a ``RuntimeError`` from its zip writer that names no error number, so a failed
``torch.save`` counts as a full disk when the file system has less free space than the write needed. The
caller keeps its own rule for what is left behind (a temporary removed, a build directory discarded):

    with disk_space(path, nbytes(state)):
        torch.save(state, tmp)
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from poslens.errors import UsageError, gib

FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# errno 28 ENOSPC, 122 EDQUOT, 27 EFBIG (a file-size limit: `ulimit -f`, RLIMIT_FSIZE; Python ignores SIGXFSZ)
_MESSAGES = ("os error 28", "os error 122", "os error 27", "no space left", "quota exceeded", "file too large")
_LIMIT = ("os error 27", "file too large")
_WRITER_FAILURES = ("inline_container", "pytorchstreamwriter", "file write failed", "i/o error")


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes an unprivileged process may still write on the file system holding `path` (or its nearest existing
    ancestor); None when unknown."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def nbytes(obj: object) -> int:
    """What writing `obj` takes, at least: the bytes of its tensors, arrays, strings and bytes, in nested dicts,
    lists and tuples (a lower bound for torch.save, safetensors and JSON)."""
    if isinstance(obj, dict):
        return sum(nbytes(k) + nbytes(v) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, str):
        return len(obj.encode("utf-8", "surrogatepass"))
    size = getattr(obj, "nbytes", None)  # torch tensors and numpy arrays
    return int(size) if isinstance(size, int) else 8


def is_disk_full(e: BaseException, path: str | os.PathLike, need: int) -> bool:
    """Whether exception `e`, raised while writing `need` bytes to `path`, means the disk (or quota, or the
    file-size limit) is full."""
    if isinstance(e, OSError) and e.errno in FULL:
        return True
    text = str(e).lower()
    if any(m in text for m in _MESSAGES):
        return True
    if isinstance(e, (RuntimeError, OSError)) or type(e).__name__ == "SafetensorError":
        free, limit = free_bytes(path), size_limit()
        return any(m in text for m in _WRITER_FAILURES) and ((free is not None and free < need)
                                                              or (limit is not None and limit < need))
    return False


def size_limit() -> int | None:
    """The largest file this process may write (RLIMIT_FSIZE, `ulimit -f`), or None when unlimited or unknown."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError, AttributeError):
        return None
    return None if soft == resource.RLIM_INFINITY else int(soft)


def is_size_limit(e: BaseException, need: int = 0) -> bool:
    """Whether `e` is the file-size limit (EFBIG, "File too large"; or a writer that names no error while the
    limit is below the `need` bytes) rather than a full disk."""
    if (isinstance(e, OSError) and e.errno == errno.EFBIG) or any(m in str(e).lower() for m in _LIMIT):
        return True
    limit = size_limit()
    return limit is not None and limit < need and not isinstance(e, OSError)


def full_message(path: str | os.PathLike, need: int, limit: bool = False) -> str:
    """The one line for a full disk (`limit`: the file-size limit): the path, the bytes needed and what is free."""
    if limit:
        return (f"cannot write {path}: the file-size limit (ulimit -f) stops it short of the {size(need)} it needs "
                "(File too large); raise the limit or write elsewhere")
    free = free_bytes(path)
    have = f", {size(free)} free" if free is not None else ""
    return (f"no space left on the device to write {path} (it needs {size(need)}{have}); free some space or write "
            "elsewhere")


def size(n: int) -> str:
    """A byte count for a message: '612 bytes', '3 MiB', '1.2 GiB'."""
    return f"{n:,} bytes" if n < 2**20 else gib(n)


@contextmanager
def disk_space(path: str | os.PathLike, need: int) -> Iterator[None]:
    """Inside the block, a write to `path` that fails for lack of space (`need`: bytes it writes) becomes a
    one-line `UsageError` naming the path and the bytes; any other error passes through unchanged."""
    try:
        yield
    except Exception as e:  # OSError, RuntimeError (torch.save), SafetensorError
        if isinstance(e, UsageError) or not is_disk_full(e, path, need):
            raise
        raise UsageError(full_message(path, need, is_size_limit(e, need))) from None


def write_failure(e: BaseException) -> str | None:
    """The one line for a failed write that reached the command line without a `disk_space` around it (a full disk,
    a quota or the file-size limit, in a library's own writer), naming the file where the error does; else None."""
    if not (isinstance(e, OSError) and e.errno in FULL) and not any(m in str(e).lower() for m in _MESSAGES):
        return None
    where = getattr(e, "filename", None)
    what = f"write {where}" if where else "write the output"
    if is_size_limit(e):
        return (f"cannot {what}: the file-size limit (ulimit -f) stops it short (File too large); raise the limit or "
                "write elsewhere")
    return f"no space left on the device to {what}; free some space or write elsewhere"
