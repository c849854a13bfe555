"""Figure 5 for any set of models: the first layers of several `scores` runs, diagonal-normalised, side by side."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from poslens import plotting
from poslens.errors import UsageError, check_int
from poslens.io.results import Run, load, run_directory, write_run
from poslens.maps import as_numpy, diagonal_normalise, quantile_limits


def first_layers(run: Run, layers: int) -> tuple[np.ndarray, list[int]]:
    """The first `layers` score maps of a `scores` run ([L, T, T]) and their layer indices (from 0); a one-line
    UsageError when the run is not a `scores` run, its scores are not [layers, T, T] maps, or a map it would
    draw has no finite entry."""
    if run.meta.get("kind") != "scores":
        raise UsageError(f"{run.path} is not a `poslens scores` run (kind {run.meta.get('kind')!r})")
    scores = as_numpy(run["scores"])
    if scores.ndim != 3 or scores.shape[0] == 0 or scores.shape[1] != scores.shape[2]:
        raise UsageError(f"{run.path}: its scores have shape {tuple(scores.shape)}, not [layers, T, T]; rerun "
                         "`poslens scores` on it")
    ids = list(range(len(scores)))
    if "layers" in run.tensors:
        ids = as_numpy(run["layers"]).reshape(-1).astype(int).tolist()
        if len(ids) != len(scores):
            raise UsageError(f"{run.path}: it names {len(ids)} layers for {len(scores)} score maps; rerun "
                             "`poslens scores` on it")
    scores, ids = scores[:layers], ids[:layers]
    for m, ell in zip(scores, ids):
        if not np.isfinite(m).any():
            raise UsageError(f"{run.path}: the scores of layer {ell + 1} are all NaN or infinite, nothing to draw; "
                             "rerun `poslens scores` on it")
    return scores, ids


def figure5(runs: list[Run], labels: list[str], directory: Path, stem: str, layers: int = 4) -> Path:
    """One row per run: its first `layers` layers, diagonal-normalised, 1%-99% quantile limits; returns the PNG."""
    drawn = [first_layers(r, layers) for r in runs]
    maps, titles, lims = [], [], []
    for sc, ids in drawn:
        for m, ell in zip(diagonal_normalise(sc), ids):
            maps.append(m)
            titles.append(f"layer {ell + 1}")  # figures count layers from 1 (docs/architecture.md)
            lims.append(quantile_limits(m))
    ncols = max(len(sc) for sc, _ in drawn)
    fig = plotting.map_grid(maps, titles, ncols=ncols, limits=lims, row_labels=labels,
                            suptitle="Diagonal-normalised mean scores, first layers (Figure 5)")
    return plotting.save(fig, directory, stem)[0]


def compare(runs: list[str], out: str, layers: int = 4, labels: list[str] | None = None,
            force: bool = False) -> Path:
    """Write a run directory with figure5.png/pdf: one row per run, its first `layers` layers."""
    check_int("first", layers, 1)
    if not runs:
        raise UsageError("runs: give at least one run directory of `poslens scores`")
    if labels and len(labels) != len(runs):
        raise UsageError(f"labels: {len(labels)} labels for {len(runs)} runs; give one per run")
    started = time.perf_counter()
    with run_directory(out, force, inputs=runs) as tmp:
        loaded = [load(r) for r in runs]
        drawn = [first_layers(r, layers) for r in loaded]  # every run checked before anything is drawn
        maps = [m for m, _ in drawn]
        labels = labels or [r.config.get("model", str(r.path)) + (" (RoPE off)" if r.config.get("no_rope") else "")
                            + (" (NoPE)" if r.config.get("pe") == "none" else "")
                            for r in loaded]
        figure5(loaded, labels, tmp / "figures", "figure5", layers)
        write_run(tmp, {f"run{k}/normalised": diagonal_normalise(m) for k, m in enumerate(maps)},
                  {"kind": "compare", "config": {"runs": [str(Path(r.path).absolute()) for r in loaded],
                                                 "labels": labels, "first": layers},
                   "metrics": {"layers": [ids for _, ids in drawn]},  # per run, the layers drawn (from 0)
                   "timings": {"seconds": time.perf_counter() - started}})
    return Path(out)
