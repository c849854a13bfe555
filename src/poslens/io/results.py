"""One results format for every command: a run directory holding `tensors.safetensors` and `run.json`.

A run directory is built in a temporary sibling directory and renamed into place only when everything
is written, so an interrupted or failed run never leaves a half-written result behind.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from poslens.errors import UsageError

TENSORS = "tensors.safetensors"
META = "run.json"


@dataclass
class Run:
    """A loaded run: named tensors plus the metadata in run.json (config, versions, seed, timings, metrics)."""

    path: Path
    tensors: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    @property
    def config(self) -> dict:
        return self.meta.get("config", {})

    @property
    def metrics(self) -> dict:
        return self.meta.get("metrics", {})


def environment() -> dict:
    """Versions and machine facts recorded with every run."""
    from poslens import __version__

    env = {
        "poslens": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(),
        "argv": sys.argv,
    }
    if "transformers" in sys.modules:
        env["transformers"] = sys.modules["transformers"].__version__
    return env


def jsonable(x):
    """Convert numpy / torch scalars and arrays (and nested containers) to plain JSON types."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def check_output(path: str | os.PathLike, force: bool = False) -> Path:
    """Fail fast (before any compute) if `path` cannot become a run directory."""
    path = Path(path).expanduser().absolute()
    if path.exists() and not force:
        raise UsageError(f"output directory {path} already exists; pass --force to overwrite or choose another --out")
    if path.exists() and not path.is_dir():
        raise UsageError(f"output path {path} exists and is not a directory; choose another --out")
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create output directory {parent}: {e.strerror}; choose a writable --out") from None
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"output directory {parent} is not writable; choose a writable --out")
    return path


@contextmanager
def run_directory(path: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces `path` atomically, on any error it is removed."""
    path = check_output(path, force)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{os.getpid()}-{time.time_ns()}"
        path.rename(old)
    tmp.rename(path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_run(directory: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write tensors (safetensors, on the CPU, contiguous) and run.json (meta + environment) into `directory`."""
    directory = Path(directory)
    cpu = {k: (v if isinstance(v, torch.Tensor) else torch.as_tensor(v)).detach().cpu().contiguous()
           for k, v in tensors.items()}
    save_file(cpu, str(directory / TENSORS))
    meta = {**meta, "environment": {**environment(), **meta.get("environment", {})}}
    (directory / META).write_text(json.dumps(jsonable(meta), indent=2, sort_keys=False) + "\n")


def load(path: str | os.PathLike, tensors: bool = True) -> Run:
    """Load a run directory written by any poslens command (`tensors=False`: run.json only)."""
    path = Path(path)
    if not (path / META).is_file() or not (path / TENSORS).is_file():
        raise UsageError(f"{path} is not a poslens run directory (needs {META} and {TENSORS})")
    try:
        meta = json.loads((path / META).read_text())
        maps = load_file(str(path / TENSORS)) if tensors else {}
    except (ValueError, OSError, SafetensorError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UsageError(f"{path}: corrupt run directory ({type(e).__name__}); rerun the command that wrote it") \
            from None
    return Run(path=path, tensors=maps, meta=meta)
