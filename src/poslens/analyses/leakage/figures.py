"""Leakage figures: component shares by depth (real models and the parameter-free stack), removal by layer,
attention on key 0 per head. Everything goes through poslens.plotting."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from poslens import plotting

SHARES = ("share_logit", "share_partition", "share_cross")
LABELS = {"share_logit": "upstream logit term", "share_partition": "this layer's log-partition term",
          "share_cross": "cross term"}


def _errors(entry: dict) -> list[np.ndarray]:
    v, lo, hi = (np.asarray(entry[k], dtype=float) for k in ("value", "lo", "hi"))
    return np.stack([v - lo, hi - v])


def leakage_figures(metrics: dict, tensors: dict, directory: Path, label: str) -> list[Path]:
    """shares_by_layer (all and early queries), removed_by_layer (each intervention), alpha0 (layer x head)."""
    paths: list[Path] = []
    for scope in ("all", "early"):
        per = metrics[f"per_layer_{scope}"]
        layers = np.arange(len(per["split/share_logit"]["value"]))
        series = {LABELS[k]: per[f"split/{k}"]["value"] for k in SHARES}
        errors = {LABELS[k]: _errors(per[f"split/{k}"]) for k in SHARES}
        fig = plotting.line_plot(layers, series, "layer", "share of ||P log A||^2",
                                 f"{label}: leakage components ({scope} queries)", errors=errors)
        paths += plotting.save(fig, directory, f"shares_by_layer_{scope}")
    if metrics.get("interventions"):
        series, errors = {}, {}
        for spec, entry in metrics["interventions"].items():
            series[spec] = entry["removed_per_layer"]["value"]
            errors[spec] = _errors(entry["removed_per_layer"])
        layers = np.arange(len(next(iter(series.values()))))
        fig = plotting.line_plot(layers, series, "layer", "removed share of the early logit part",
                                 f"{label}: position-0 interventions", errors=errors)
        paths += plotting.save(fig, directory, "removed_by_layer")
    alpha = np.asarray(tensors["alpha0"], dtype=float)
    fig = plotting.map_grid([alpha], [f"{label}: mean attention on key 0 (layer x head)"], limits=(0.0, 1.0))
    for ax in fig.axes[:1]:
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
    paths += plotting.save(fig, directory, "alpha0")
    return paths


def architecture_figure(results: dict[str, dict], directory: Path, stem: str = "architectures",
                        title: str = "leakage components") -> list[Path]:
    """Component shares by depth per architecture: `results` maps an architecture (or model) name to
    {"share_logit": [L], "share_partition": [L]} (optionally "<key>_err": [2, L] error bars); one figure per component,
    stem_logit and stem_partition (depths may differ: shorter series end early)."""
    paths: list[Path] = []
    depth = max(len(np.asarray(r["share_logit"])) for r in results.values())
    for key, short in (("share_logit", "logit"), ("share_partition", "partition")):
        series, errors = {}, {}
        for arch, shares in results.items():
            v = np.asarray(shares[key], dtype=float)
            series[arch] = np.pad(v, (0, depth - len(v)), constant_values=np.nan)
            if f"{key}_err" in shares:
                e = np.asarray(shares[f"{key}_err"], dtype=float)
                errors[arch] = np.pad(e, ((0, 0), (0, depth - e.shape[1])), constant_values=np.nan)
        fig = plotting.line_plot(np.arange(depth), series, "layer", f"{LABELS[key]} share",
                                 f"{title}: {LABELS[key]}", errors=errors or None)
        paths += plotting.save(fig, directory, f"{stem}_{short}")
    return paths
