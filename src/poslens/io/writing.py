"""Complete writes: every byte poslens writes is counted, checked and hashed as it goes.

A write that stops short (a full disk, a quota, a file-size limit such as ``ulimit -f``: "File too large") is a
one-line `UsageError` naming the file, the bytes written and the bytes it needed (`poslens.io.space.disk_space`);
the caller's rule for what is left behind applies (a run's build directory is removed, so nothing half-written is
placed or reported). After closing, the file's size on disk is compared with the bytes written (`check_size`):
a writer that loses an error (a library that ignores a failed flush) is caught there too.

What a writer here writes is hashed (SHA-256) while it is written and remembered for this process (`recorded`),
so the run's manifest (`poslens.io.manifest.write_manifest`) lists the content hash of a large tensors file
without reading it again. Files written by other libraries (figures, ``save_pretrained``) are hashed once, when
the manifest is written.

`write_tensors` writes the safetensors format itself, one tensor at a time (no second copy of the tensors in
memory): header length (8 bytes, little-endian), the JSON header (metadata first) padded with spaces to a multiple
of 8, then the tensors' bytes, ordered as safetensors orders them, so the file is byte-identical to
`safetensors.torch.save_file`'s (with metadata, up to the order of its keys, which safetensors takes from a hash map).
Checkpoints (`poslens.io.checkpoint`) are written by it too, without the hash (``hashed=False``): a checkpoint is
never in a manifest, and hashing gigabytes of partial maps at every save cost a GPU run more than its forwards.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path

from poslens.errors import UsageError
from poslens.io.space import disk_space, size

__all__ = ["check_size", "file_sha256", "recorded", "remember", "write_bytes", "write_tensors", "write_text"]

_CHUNK = 1 << 22  # bytes per write and per read of a hash
_WRITTEN: dict[str, tuple[int, int, str]] = {}  # real path -> (size, mtime_ns, sha256) of what a writer here wrote

# safetensors' dtype names, in the order of its Dtype enum (tensors are stored by that order, descending, then name)
_DTYPES = ("bool", "uint8", "int8", "float8_e5m2", "float8_e4m3fn", "int16", "uint16", "float16", "bfloat16",
           "int32", "uint32", "float32", "complex64", "float64", "int64", "uint64")
_NAMES = {"bool": "BOOL", "uint8": "U8", "int8": "I8", "float8_e5m2": "F8_E5M2", "float8_e4m3fn": "F8_E4M3",
          "int16": "I16", "uint16": "U16", "float16": "F16", "bfloat16": "BF16", "int32": "I32", "uint32": "U32",
          "float32": "F32", "complex64": "C64", "float64": "F64", "int64": "I64", "uint64": "U64"}


def remember(path: str | os.PathLike, digest: str) -> None:
    """Record the SHA-256 of a file a writer hashed as it wrote it (for the manifest; see `recorded`)."""
    st = os.stat(path)
    _WRITTEN[os.path.realpath(path)] = (st.st_size, st.st_mtime_ns, digest)


def recorded(path: str | os.PathLike) -> str | None:
    """The SHA-256 a writer of this module computed for `path`, if the file is still as it left it (size and
    modification time), else None."""
    got = _WRITTEN.get(os.path.realpath(path))
    if got is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    return got[2] if (st.st_size, st.st_mtime_ns) == got[:2] else None


def file_sha256(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's content (the recorded one when a writer here wrote it; else read in chunks)."""
    known = recorded(path)
    if known is not None:
        return known
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def check_size(path: str | os.PathLike, expected: int) -> None:
    """A one-line error when `path` does not hold `expected` bytes after its writer closed it (a short write)."""
    try:
        got = os.stat(path).st_size
    except OSError as e:
        raise UsageError(f"{path} could not be written ({e.strerror}); free some space or write elsewhere") from None
    if got != expected:
        raise UsageError(f"{path} was written short: {size(got)} of {size(expected)} reached the disk (a full disk "
                         "or a file-size limit, ulimit -f); free some space, raise the limit or write elsewhere")


class _Out:
    """A file opened for a complete write: `put` writes every byte or raises; the bytes are counted and hashed."""

    def __init__(self, path: Path, need: int, hashed: bool = True):
        self.path, self.need, self.done = path, need, 0
        self.hash = hashlib.sha256() if hashed else None
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)

    def put(self, data) -> None:
        view = memoryview(data).cast("B")
        if self.hash is not None:
            self.hash.update(view)
        while len(view):
            n = os.write(self.fd, view[:_CHUNK])
            if n <= 0:  # no error number: the device took nothing
                raise UsageError(f"{self.path} was written short: {size(self.done)} of {size(self.need)} reached "
                                 "the disk; free some space or write elsewhere")
            self.done += n
            view = view[n:]

    def close(self) -> None:
        os.close(self.fd)


def _write(path: Path, parts, need: int, hashed: bool = True) -> None:
    """Write the buffers `parts` (an iterable) to `path`: complete, checked, and (`hashed`) hashed and remembered."""
    path = Path(path)
    with disk_space(path, need):
        out = _Out(path, need, hashed)
        try:
            for part in parts:
                out.put(part)
        finally:
            out.close()
    check_size(path, need)
    if out.hash is not None:
        remember(path, out.hash.hexdigest())


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` completely (a short write is a one-line error naming the file and the bytes)."""
    _write(Path(path), [data], len(data))


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` completely."""
    write_bytes(path, text.encode("utf-8"))


def write_tensors(path: str | os.PathLike, tensors: Mapping[str, object],
                  metadata: Mapping[str, str] | None = None, hashed: bool = True) -> None:
    """Write CPU tensors to `path` in the safetensors format, one tensor at a time (see the module docstring), with
    `metadata` (text to text) first in the header, as safetensors stores it; `hashed` False for a file no manifest
    lists (a checkpoint)."""
    import torch

    def name(t: torch.Tensor) -> str:
        key = str(t.dtype).removeprefix("torch.")
        if key not in _NAMES:
            raise UsageError(f"{path}: cannot store a tensor of dtype {key} in safetensors")
        return key

    cpu = {k: v.detach().cpu().contiguous() for k, v in tensors.items()}
    order = sorted(cpu, key=lambda k: (-_DTYPES.index(name(cpu[k])), k))
    header, offset = ({"__metadata__": dict(metadata)} if metadata is not None else {}), 0
    for k in order:
        t = cpu[k]
        header[k] = {"dtype": _NAMES[name(t)], "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)

    def parts():
        yield len(text).to_bytes(8, "little")
        yield text
        for k in order:
            t = cpu[k]
            if t.nbytes:
                yield t.reshape(-1).view(torch.uint8).numpy()

    _write(Path(path), parts(), 8 + len(text) + offset, hashed)
