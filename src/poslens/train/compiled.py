"""Compiled code for the batched trainer (`poslens.train.batched`), kept on disk so that it is compiled once per
machine, not once per process.

``torch.compile`` (inductor) of one decoder layer of N models (`poslens.train.batched.decoder_layer`), shapes
static: its forward and backward graphs become C++ kernels that fuse the elementwise work eager PyTorch does op by
op (RMSNorm, the rotary products, SiLU times the up projection, the residual adds, their backward). Inductor's
FX-graph and AOTAutograd caches are on by default; `use_disk_cache` points them at ``$POSLENS_CACHE/inductor``
(unless ``TORCHINDUCTOR_CACHE_DIR`` names another directory than inductor's default), so a second worker process,
and every later sweep on the same machine and torch, loads the compiled kernels instead of compiling them again.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cache_dir() -> Path:
    """Where poslens keeps inductor's compiled code: ``inductor/`` under the poslens cache."""
    from poslens.io.protect import cache_root

    return cache_root() / "inductor"


def _torch_default() -> str:
    """Inductor's own cache directory, the one it sets ``TORCHINDUCTOR_CACHE_DIR`` to when it first needs one."""
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # another torch: its default as torch 2.4-2.13 compute it
        import getpass
        import tempfile

        return os.path.join(tempfile.gettempdir(), "torchinductor_" + getpass.getuser())
    return default_cache_dir()


def use_disk_cache() -> Path:
    """Point inductor's on-disk caches at `cache_dir` unless ``TORCHINDUCTOR_CACHE_DIR`` names another directory
    than inductor's default (the user's choice, or this process's earlier call); returns the directory in use.
    Worker processes inherit it. Importing transformers' models sets the variable to inductor's default (torch's
    ``cache_dir()`` writes it back), so a value equal to that default is not taken for a choice."""
    given = os.environ.get(CACHE_ENV)
    if not given or os.path.abspath(given) == os.path.abspath(_torch_default()):
        os.environ[CACHE_ENV] = str(cache_dir())
    path = Path(os.environ[CACHE_ENV])
    path.mkdir(parents=True, exist_ok=True)
    return path


def compile_static(fn: Callable[..., Any]) -> Callable[..., Any] | None:
    """`fn` through ``torch.compile`` with inductor, shapes static and the whole function one graph (a graph break
    is an error, so the caller falls back to eager code instead of running a half-compiled function), its code
    cached on disk (`use_disk_cache`). Compilation is lazy: it happens, or fails, at the first call; after a
    failure (`failed`) this process asks no more and gets None: eager."""
    import torch

    if _FAILED:
        return None
    use_disk_cache()
    if fn not in _COMPILED:  # one wrapper per function and process: its compiled graphs are reused by every caller
        _COMPILED[fn] = torch.compile(fn, dynamic=False, fullgraph=True)
    return _COMPILED[fn]


_COMPILED: dict[Callable[..., Any], Callable[..., Any]] = {}


def root_cause(error: BaseException) -> BaseException:
    """The innermost error under the compiler's wrappers (dynamo's ``BackendCompilerFailed``, inductor's
    ``InductorError``: their ``inner_exception``; else ``__cause__``)."""
    seen = set()
    while id(error) not in seen:
        seen.add(id(error))
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if not isinstance(inner, BaseException):
            break
        error = inner
    return error


def eager_fallback_line(error: BaseException) -> str:
    """The one line that says compiled training failed and why (`root_cause`), and that training goes on
    eagerly."""
    error = root_cause(error)
    first = (str(error).strip().splitlines() or [""])[0][:200]
    return (f"poslens: compiled training is unavailable here ({type(error).__name__}: {first}); training eagerly "
            "(the same models up to float32 rounding)")


def failed(error: BaseException) -> None:
    """Compiled code failed in this process: say so in one line on stderr (`eager_fallback_line`), once; every
    later `compile_static` gives None (eager)."""
    global _FAILED
    if not _FAILED:
        print(eager_fallback_line(error), file=sys.stderr, flush=True)
    _FAILED = True


_FAILED = False
