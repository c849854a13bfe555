"""Partial sums that survive an interruption: saved atomically every N units of work, resumed exactly.

A long accumulation (Monte Carlo chunks, batches of sequences) keeps named sum tensors and a count of
finished units. `save_partial` writes them with a fingerprint of the run's configuration; `load_partial`
refuses a file whose fingerprint differs and reports a corrupt file as a one-line error.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from poslens.errors import UsageError

DONE_KEY = "__done__"


def fingerprint(config: dict) -> str:
    """Stable hash of a JSON-serialisable configuration."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def save_partial(path: str | os.PathLike, sums: dict[str, torch.Tensor], done: int, config: dict) -> None:
    """Atomically write `sums` and the number of finished units `done` (write to a temp file, then rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    tensors = {k: v.detach().cpu().contiguous() for k, v in sums.items()}
    save_file(tensors, str(tmp), metadata={DONE_KEY: str(int(done)), "fingerprint": fingerprint(config)})
    os.replace(tmp, path)


def load_partial(path: str | os.PathLike, config: dict) -> tuple[dict[str, torch.Tensor], int] | None:
    """Return (sums, done) from a checkpoint written for the same `config`, or None if there is none."""
    path = Path(path)
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
        raise UsageError(f"checkpoint {path} belongs to a different configuration; delete it or use another --out")
    return sums, done
