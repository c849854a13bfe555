"""One results format for every command: a run directory holding `tensors.safetensors` and `run.json`.

A run directory is built aside and renamed into place only when everything is written, so an interrupted
or failed run never leaves a half-written result behind; `--force` replaces only a run poslens wrote (its
run.json carries `"poslens_run": 1`). The mechanism (locking, leftovers, resumable work directories) is
`poslens.io.rundir`; `check_output` and `run_directory` are re-exported here.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from poslens.errors import UsageError
from poslens.io.rundir import MARKER, check_output, open_run, run_directory, sharded_run_directory
from poslens.io.writing import write_tensors, write_text

__all__ = ["META", "TENSORS", "Run", "check_complete", "check_output", "environment", "jsonable", "load", "open_run",
           "run_directory", "sharded_run_directory", "write_run"]

TENSORS = "tensors.safetensors"
META = "run.json"


@dataclass
class Run:
    """A loaded run: named tensors plus the metadata in run.json (config, versions, seed, timings, metrics)."""

    path: Path
    tensors: dict[str, torch.Tensor]
    meta: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            have = ", ".join(sorted(self.tensors)[:8]) or "none"
            raise UsageError(f"{self.path}: the run has no tensor {name!r} (it has: {have}); rerun the command "
                             "that writes it")
        return self.tensors[name]

    @property
    def config(self) -> dict:
        return self.meta.get("config", {})

    @property
    def metrics(self) -> dict:
        return self.meta.get("metrics", {})


@functools.lru_cache(maxsize=1)
def source_revision() -> str:
    """The git commit of the poslens source (with '+ local changes' when the tree differs), else its version; asked
    of git once per process (every run a process writes records it)."""
    from poslens import __version__

    here = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if rev.returncode == 0 and rev.stdout.strip():
            dirty = subprocess.run(["git", "status", "--porcelain", "--", str(here)], cwd=here,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return f"git {rev.stdout.strip()}" + (" + local changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return f"poslens {__version__} (no git checkout)"


def environment() -> dict:
    """Versions, the source revision, the date and machine facts recorded with every run."""
    from poslens import __version__

    env = {
        "poslens": __version__,
        "source": source_revision(),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy": np.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "torch_threads": torch.get_num_threads(),
        "cpu": cpu_name(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),  # the instruction set torch's CPU kernels use
        "argv": sys.argv,
    }
    try:  # installed, even where this run never imported it (simulate, gramflow)
        env["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
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


def write_run(directory: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """Write tensors (safetensors, on the CPU, contiguous) and run.json (meta + environment) into `directory`.
    A full disk or a short write is a one-line UsageError naming the file and its size (the caller's build
    directory goes)."""
    directory = Path(directory)
    cpu = {k: (v if isinstance(v, torch.Tensor) else torch.as_tensor(v)).detach().cpu().contiguous()
           for k, v in tensors.items()}
    write_tensors(directory / TENSORS, cpu)  # complete and hashed as it is written (poslens.io.writing)
    rest = {k: v for k, v in meta.items() if k != MARKER}  # the marker is poslens's to set, first in the file
    meta = {MARKER: 1, **rest, "environment": {**environment(), **meta.get("environment", {})}}
    text = json.dumps(jsonable(meta), indent=2, sort_keys=False) + "\n"
    write_text(directory / META, text)


def load(path: str | os.PathLike, tensors: bool = True) -> Run:
    """Load a run directory written by any poslens command (`tensors=False`: run.json only)."""
    path = Path(path)
    if not (path / META).is_file() or not (path / TENSORS).is_file():
        raise UsageError(f"{path} is not a poslens run directory (needs {META} and {TENSORS})")
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
        maps = load_file(str(path / TENSORS)) if tensors else {}
    except (ValueError, OSError, SafetensorError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise UsageError(f"{path}: corrupt run directory ({type(e).__name__}); rerun the command that wrote it") \
            from None
    wrong = [k for k in ("config", "metrics", "environment") if isinstance(meta, dict) and k in meta
             and not isinstance(meta[k], dict)]
    if not isinstance(meta, dict) or wrong:
        what = f"{META} is not a JSON object" if not isinstance(meta, dict) else f"{wrong[0]!r} is not an object"
        raise UsageError(f"{path}: corrupt run directory ({what}); rerun the command that wrote it")
    return Run(path=path, tensors=maps, meta=meta)


def check_complete(run: str | os.PathLike) -> None:
    """A one-line error unless the run's tensors file is as long as its header says (reads the header only): for a
    reader of run.json alone (`load(..., tensors=False)`) that must not accept a run cut short."""
    path = Path(run) / TENSORS
    try:
        _complete(path)
    except UsageError:
        raise
    except (ValueError, OSError, RecursionError, KeyError, TypeError, IndexError) as e:
        raise UsageError(f"{run}: corrupt run directory ({TENSORS}: {type(e).__name__}); rerun the command that "
                         "wrote it") from None


def _complete(path: Path) -> None:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if n > 100 << 20:
            raise ValueError("header too large")
        header = json.loads(f.read(n))
    entries = [v for k, v in header.items() if k != "__metadata__"] if isinstance(header, dict) else None
    if entries is None or not all(isinstance(v, dict) and isinstance(v.get("data_offsets"), list) for v in entries):
        raise ValueError("malformed header")
    want, got = 8 + n + max((int(v["data_offsets"][-1]) for v in entries), default=0), path.stat().st_size
    if got != want:
        raise UsageError(f"{path.parent}: corrupt run directory ({path.name} holds {got:,} bytes, its header says "
                         f"{want:,}: cut short or changed); rerun the command that wrote it")


def cpu_name() -> str:
    """The processor's model name (Linux: /proc/cpuinfo), else platform's; models trained on processors with other
    instruction sets (torch's CPU capability, e.g. AVX2 against AVX512) round differently and drift apart."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown processor"
