"""Figure 5 for any set of models: the first layers of several `scores` runs, diagonal-normalised, side by side."""

from __future__ import annotations

from pathlib import Path

from poslens import plotting
from poslens.errors import UsageError, check_int
from poslens.io.results import Run, load, run_directory, write_run
from poslens.maps import as_numpy, diagonal_normalise, quantile_limits


def figure5(runs: list[Run], labels: list[str], directory: Path, stem: str, layers: int = 4) -> Path:
    """One row per run: its first `layers` layers, diagonal-normalised, 1%-99% quantile limits; returns the PNG."""
    maps, titles, lims = [], [], []
    for r in runs:
        sc = as_numpy(r["scores"])[:layers]
        ids = r.tensors["layers"].tolist()[:layers] if "layers" in r.tensors else list(range(len(sc)))
        for m, ell in zip(diagonal_normalise(sc), ids):
            maps.append(m)
            titles.append(f"layer {ell + 1}")  # figures count layers from 1 (docs/architecture.md)
            lims.append(quantile_limits(m))
    ncols = max(min(layers, len(as_numpy(r["scores"]))) for r in runs)
    fig = plotting.map_grid(maps, titles, ncols=ncols, limits=lims, row_labels=labels,
                            suptitle="Diagonal-normalised mean scores, first layers (Figure 5)")
    return plotting.save(fig, directory, stem)[0]


def compare(runs: list[str], out: str, layers: int = 4, labels: list[str] | None = None,
            force: bool = False) -> Path:
    """Write a run directory with figure5.png/pdf: one row per run, its first `layers` layers."""
    check_int("first", layers, 1)
    loaded = [load(r) for r in runs]
    for r in loaded:
        if r.meta.get("kind") != "scores":
            raise UsageError(f"{r.path} is not a `poslens scores` run (kind {r.meta.get('kind')!r})")
    if labels and len(labels) != len(loaded):
        raise UsageError(f"--labels needs one label per run ({len(loaded)}), got {len(labels)}")
    labels = labels or [r.config.get("model", str(r.path)) + (" (RoPE off)" if r.config.get("no_rope") else "")
                        + (" (NoPE)" if r.config.get("pe") == "none" else "")
                        for r in loaded]
    with run_directory(out, force) as tmp:
        figure5(loaded, labels, tmp / "figures", "figure5", layers)
        write_run(tmp, {f"run{k}/normalised": as_numpy(diagonal_normalise(as_numpy(r["scores"])[:layers]))
                        for k, r in enumerate(loaded)},
                  {"kind": "compare", "config": {"runs": [str(r.path) for r in loaded], "labels": labels,
                                                 "first": layers}})
    return Path(out)
