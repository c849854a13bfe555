"""Partial sums that survive an interruption: saved atomically every N units of work (or by time, `Cadence`), resumed
exactly.

A long accumulation (Monte Carlo chunks, batches of sequences) keeps named sum tensors and a count of
finished units. `save_partial` writes them with a fingerprint of the run's configuration; `load_partial`
refuses a file whose fingerprint differs and reports a corrupt file as a one-line error.
Temporaries are `NAME.tmp-PID`: removed if the write fails, and (when their writer is gone) by the next
save or load of the same checkpoint. `read_cache` / `write_cache` keep finished results (reproduce's cache):
a corrupt entry is reported on its own line, deleted and recomputed instead of failing every rerun.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from poslens.errors import UsageError
from poslens.io.rundir import share, stale_tmp
from poslens.io.space import disk_space, nbytes
from poslens.io.writing import write_tensors

DONE_KEY = "__done__"
CHECKPOINT_SECONDS = 10.0  # the shortest interval between saves by time
SAVE_SHARE = 0.1  # by time, saving takes at most this share of the run


class Cadence:
    """When partial sums are saved: after every `every` units of work when it is given; otherwise by time, once at
    least CHECKPOINT_SECONDS have passed since the last save (or the start) and at least (1 / SAVE_SHARE - 1) times as
    long as the last save took, so that saving costs at most SAVE_SHARE of the run however large the sums are (on a
    GPU a save of gigabytes of maps can take longer than the units it protects). Where the saves fall changes
    nothing in the result: a resumed run continues from any unit boundary to the same sums."""

    def __init__(self, every: int | None = None):
        self.every, self.last, self.cost = every, time.monotonic(), 0.0

    def due(self, units: int) -> bool:
        """Whether to save now, after `units` units of this run."""
        if self.every is not None:
            return units % self.every == 0
        return time.monotonic() - self.last >= max(CHECKPOINT_SECONDS, self.cost * (1 / SAVE_SHARE - 1))

    def save(self, path: str | os.PathLike, sums: dict[str, torch.Tensor], done: int, config: dict) -> None:
        """`save_partial`, timed for the next `due`."""
        start = time.monotonic()
        save_partial(path, sums, done, config)
        self.last = time.monotonic()
        self.cost = self.last - start


def fingerprint(config: dict) -> str:
    """Stable hash of a JSON-serialisable configuration."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def save_partial(path: str | os.PathLike, sums: dict[str, torch.Tensor], done: int, config: dict) -> None:
    """Atomically write `sums` and the number of finished units `done` (write to a temp file, then rename)."""
    path = Path(path)
    tensors = {k: v.detach().cpu().contiguous() for k, v in sums.items()}
    _atomic_save(path, tensors, {DONE_KEY: str(int(done)), "fingerprint": fingerprint(config)})


def _atomic_save(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None) -> None:
    """Write NAME.tmp-PID (safetensors, a tensor at a time: no second copy of the sums in memory), then rename over
    NAME; the temporary never outlives a failed write, and a full disk is a one-line UsageError naming NAME and the
    bytes it needed (the previous NAME stays)."""
    _clean_stale(path)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    try:
        with disk_space(path, nbytes(tensors) + nbytes(metadata or {}) + 1024):
            write_tensors(tmp, tensors, metadata, hashed=False)  # never in a manifest
        share(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _clean_stale(path: Path) -> None:
    """Remove NAME.tmp-PID files next to `path` whose writing process is gone (a killed save)."""
    try:
        for p in path.parent.glob(path.name.replace("[", "[[]") + ".tmp-*"):
            if stale_tmp(p):
                p.unlink(missing_ok=True)
    except OSError:
        pass


def load_partial(path: str | os.PathLike, config: dict,
                 replace: bool = False) -> tuple[dict[str, torch.Tensor], int] | None:
    """Return (sums, done) from a checkpoint written for the same `config`, or None if there is none. One written
    for another `config` is refused, or with `replace` removed (the run starts over)."""
    path = Path(path)
    _clean_stale(path)
    if not path.exists():
        return None
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        sums = load_file(str(path))
        done = int(meta[DONE_KEY])
    except (SafetensorError, KeyError, ValueError, OSError) as e:
        raise UsageError(f"checkpoint {path} is corrupt ({type(e).__name__}); delete it to start over") from None
    if meta.get("fingerprint") != fingerprint(config):
        if replace:
            path.unlink()
            return None
        raise UsageError(f"checkpoint {path} belongs to a different configuration (an interrupted run with other "
                         "options, or on other inputs: model files, text); pass --force to start over, or choose "
                         "another --out")
    return sums, done


def read_cache(path: str | os.PathLike) -> dict[str, torch.Tensor] | None:
    """Tensors of a finished-result cache file, or None when there is none. A corrupt file is reported
    (on its own line, naming it), deleted and treated as absent, so the caller recomputes it."""
    path = Path(path)
    _clean_stale(path)
    if not path.exists():
        return None
    try:
        return load_file(str(path))
    except (SafetensorError, ValueError, OSError) as e:
        print(f"\nposlens: cache file {path} is corrupt ({type(e).__name__}); deleted, recomputing it",
              file=sys.stderr, flush=True)
        path.unlink(missing_ok=True)
        return None


def write_cache(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """Atomically write a finished-result cache file (read it back with `read_cache`)."""
    _atomic_save(Path(path), {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, None)
