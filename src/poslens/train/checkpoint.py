"""Training checkpoints: the model (``save_pretrained``), optimizer, scheduler, RNG states and step.

A checkpoint is a directory written beside its final name and renamed into place (the previous one is
moved aside first and deleted after), so an interruption at any moment leaves one complete checkpoint.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from poslens.errors import UsageError

NAME = "checkpoint"
STATE = "trainer.pt"


def rng_state() -> dict[str, Any]:
    """Every random-number generator a training step may draw from."""
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators saved by `rng_state`."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(work: Path, model: Any, model_state: dict[str, torch.Tensor] | None, trainer: dict[str, Any],
         tokenizer: Any = None) -> Path:
    """Write a checkpoint into `work`/checkpoint atomically (write a sibling, then rename). A full disk is a
    one-line UsageError naming the file and the bytes it needed; the previous checkpoint stays."""
    from poslens.io.rundir import share_tree
    from poslens.io.space import disk_space, nbytes

    final = work / NAME
    tmp = work / f".{NAME}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    weights = model_state if model_state is not None else model.state_dict()
    try:
        with disk_space(tmp / "model.safetensors", nbytes(weights)):
            model.save_pretrained(tmp, state_dict=model_state)
        if tokenizer is not None:
            with disk_space(tmp, 1 << 20):
                tokenizer.save_pretrained(tmp)
        with disk_space(tmp / STATE, nbytes(trainer)):
            torch.save(trainer, tmp / STATE)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    share_tree(tmp)  # safetensors writes the weights 0600: the umask's permissions, as every file poslens writes
    old = work / f"{NAME}.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def find(work: Path) -> Path | None:
    """The newest complete checkpoint in `work`, or None (half-written ones of killed runs are removed)."""
    if work.is_dir():
        for tmp in work.glob(f".{NAME}.tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)
    for name in (NAME, f"{NAME}.old"):  # .old survives only an interruption between the two renames
        if (work / name / STATE).is_file():
            return work / name
    return None


def load_trainer(path: Path) -> dict[str, Any]:
    """The optimizer/scheduler/RNG/step state of checkpoint `path` (one-line error if unreadable)."""
    try:
        return torch.load(path / STATE, map_location="cpu", weights_only=False)
    except (OSError, RuntimeError, EOFError, ValueError) as e:
        raise UsageError(f"checkpoint {path} is corrupt ({type(e).__name__}); delete it to start over") from None


def load_weights(path: Path, model: torch.nn.Module) -> None:
    """Copy the saved weights of checkpoint `path` into `model` (tied LM head may be absent from the file)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        files = sorted(path.glob("*.safetensors"))
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_file(str(f)))
    except (OSError, SafetensorError) as e:
        raise UsageError(f"checkpoint {path} is corrupt ({type(e).__name__}); delete it to start over") from None
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError:  # a shape differs
        raise UsageError(f"checkpoint {path} holds another architecture (weight shapes differ); delete it or "
                         "choose another --out") from None
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        raise UsageError(f"checkpoint {path} holds another architecture ({len(missing)} missing, "
                         f"{len(result.unexpected_keys)} unexpected weights); delete it or choose another --out")
