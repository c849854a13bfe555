"""Run a parameter-free stack (Monte Carlo or Gram flow), summarise it, and write a run directory.

`poslens simulate` and `poslens gramflow` go through `write_stack_run` (and `reproduce` through the same
`score_limits`), so a stack's maps, metrics and figures look the same wherever they come from.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from poslens import plotting
from poslens.io.results import write_run
from poslens.maps import as_numpy, rows_increasing, toeplitz_residual
from poslens.stack.config import StackConfig


def score_limits(config: StackConfig) -> tuple[float, float] | str:
    """The paper's colour limits for raw scores: [0, 1] for l2 and LayerNorm-d, [0, 8] for LayerNorm-sqrt-d (NoPE)."""
    if config.positional == "rope":
        return "each"
    return (0.0, 8.0) if config.norm == "layernorm-sqrt-d" else (0.0, 1.0)


def summarise(config: StackConfig, scores, se=None) -> dict:
    """Per-layer metrics of the mean score maps [L, n, n] (se: their standard errors, Monte Carlo only)."""
    scores = as_numpy(scores)
    causal = config.mask != "none"
    layers = []
    for ell, m in enumerate(scores, start=1):
        entry = {"layer": ell, "toeplitz_residual": toeplitz_residual(m, causal=causal)}
        if causal:
            holding, checked = rows_increasing(m)
            entry["rows_increasing"] = {"holding": holding, "checked": checked}
        finite = m[np.isfinite(m)]
        entry["range"] = [float(finite.min()), float(finite.max())]
        if se is not None:
            s = as_numpy(se[ell - 1])
            entry["max_se"] = float(np.nanmax(s))
        layers.append(entry)
    return {"layers": layers}


def figures(config: StackConfig, scores, directory: Path, stem: str, label: str) -> list[Path]:
    """All layers' mean scores (and their diagonal-normalised version with RoPE or without a mask)."""
    titles = [f"layer {ell}" for ell in range(1, len(scores) + 1)]
    return plotting.layer_maps(scores, directory, stem, label, titles, limits=score_limits(config),
                               normalised=config.positional == "rope" or config.mask == "none",
                               causal=config.mask != "none")


def write_stack_run(directory: Path, config: StackConfig, tensors: dict, kind: str, extra: dict,
                    started: float, draw: bool = True) -> dict:
    """Write tensors, run.json (config, metrics, timing) and figures into `directory`; return the metrics.

    The score maps (Monte Carlo `scores_mean` with `scores_se`, or Gram-flow `scores`) give the metrics and
    figures; a run without them (`simulate --maps probs`) writes its tensors only."""
    scores = tensors.get("scores_mean", tensors.get("scores"))
    metrics = summarise(config, scores, tensors.get("scores_se")) if scores is not None else {"layers": []}
    if draw and scores is not None:
        figures(config, scores, directory / "figures", "scores", kind)
    write_run(directory, tensors, {"kind": kind, "config": config.to_dict(), **extra, "metrics": metrics,
                                   "timings": {"seconds": time.perf_counter() - started}})
    return metrics
