"""Leakage figures: component shares and energies by depth, removal by layer, residual fractions against their
nulls, attention on key 0 per head (real models and the parameter-free stack). Everything goes through
poslens.plotting."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from poslens import plotting

SHARES = ("share_mask_only", "share_residual", "share_cross")
FIGURE_SHARES = SHARES[:2]  # the components `architecture_figure` draws
LABELS = {"share_mask_only": "mask-only term (causal softmax of the lag profile)",
          "share_residual": "residual term (scores beyond lag and per-query offset)", "share_cross": "interaction"}


def _errors(entry: dict) -> list[np.ndarray]:
    v, lo, hi = (np.asarray(entry[k], dtype=float) for k in ("value", "lo", "hi"))
    return np.stack([v - lo, hi - v])


TERMS = {"attn/e_total": "non-relative energy of log A", "attn/mask_only": "mask-only term",
         "attn/residual": "residual term"}
KEY0 = {"key0_in": "key 0 in", "key0_out": "key 0 out"}


def leakage_figures(metrics: dict, tensors: dict, directory: Path, label: str) -> list[Path]:
    """shares_by_layer_{all,early} (the decomposition's shares, key 0 in), energies_by_layer_{all,early} (its
    terms, key 0 in and out), removed_by_layer (each intervention and null: the share of the residual term it
    removes at early queries, key 0 in and out), fractions_against_nulls (the residual fraction
    of the scores, original and each null), alpha0 (layer x head). Layers from 1."""
    paths: list[Path] = []
    layers = np.arange(1, metrics["layers"] + 1)
    for scope in ("all", "early"):
        per = metrics[f"per_layer_{scope}"]
        series = {LABELS[k]: per[f"attn/{k}"]["value"] for k in SHARES}
        errors = {LABELS[k]: _errors(per[f"attn/{k}"]) for k in SHARES}
        fig = plotting.line_plot(layers, series, "layer", "share of ||P log A||^2",
                                 f"{label}: the decomposition's shares ({scope} queries, key 0 in)", errors=errors)
        paths += plotting.save(fig, directory, f"shares_by_layer_{scope}")
        per = metrics["original"]["per_layer"][scope]
        series, errors = {}, {}
        for term, name in TERMS.items():
            for k, key0 in KEY0.items():
                series[f"{name}, {key0}"] = per[term][k]["value"]
                errors[f"{name}, {key0}"] = _errors(per[term][k])
        fig = plotting.line_plot(layers, series, "layer", "non-relative energy of log A",
                                 f"{label}: energies by layer ({scope} queries)", errors=errors, logy=True)
        paths += plotting.save(fig, directory, f"energies_by_layer_{scope}")
    contrasts = {**metrics.get("interventions", {}), **metrics.get("nulls", {})}
    if contrasts:
        series, errors = {}, {}
        for name, entry in contrasts.items():
            for k, key0 in KEY0.items():
                e = entry["per_layer"]["removed"]["early"]["attn/residual"][k]
                series[f"{name}, {key0}"], errors[f"{name}, {key0}"] = e["value"], _errors(e)
        fig = plotting.line_plot(layers, series, "layer", "removed share of the residual term",
                                 f"{label}: interventions and nulls (early queries)", errors=errors)
        paths += plotting.save(fig, directory, "removed_by_layer")
    if metrics.get("nulls"):
        series, errors = {}, {}
        for k, key0 in KEY0.items():
            e = metrics["original"]["per_layer"]["all"]["scores/trf"][k]
            series[f"original, {key0}"], errors[f"original, {key0}"] = e["value"], _errors(e)
            for name, entry in metrics["nulls"].items():
                e = entry["per_layer"]["pass"]["all"]["scores/trf"][k]
                series[f"{name} null, {key0}"], errors[f"{name} null, {key0}"] = e["value"], _errors(e)
        fig = plotting.line_plot(layers, series, "layer", "Toeplitz-residual fraction of the scores",
                                 f"{label}: residual fraction against its nulls (all queries)", errors=errors)
        paths += plotting.save(fig, directory, "fractions_against_nulls")
    alpha = np.asarray(tensors["original/alpha0"], dtype=float)
    fig = plotting.map_grid([alpha], [f"{label}: mean attention on key 0 (layer x head, from 1)"], limits=(0.0, 1.0))
    for ax in fig.axes[:1]:
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
    paths += plotting.save(fig, directory, "alpha0")
    return paths


def architecture_figure(results: dict[str, dict], directory: Path, stem: str = "architectures",
                        title: str = "leakage components") -> list[Path]:
    """Component shares by depth per architecture: `results` maps an architecture (or model) name to
    {"share_mask_only": [L], "share_residual": [L]} (optionally "<key>_err": [2, L] error bars); one figure per
    component, stem_mask_only and stem_residual (depths may differ: shorter series end early)."""
    paths: list[Path] = []
    depth = max(len(np.asarray(r[FIGURE_SHARES[0]])) for r in results.values())
    for key in FIGURE_SHARES:
        short = key.removeprefix("share_")
        series, errors = {}, {}
        for arch, shares in results.items():
            v = np.asarray(shares[key], dtype=float)
            series[arch] = np.pad(v, (0, depth - len(v)), constant_values=np.nan)
            if f"{key}_err" in shares:
                e = np.asarray(shares[f"{key}_err"], dtype=float)
                errors[arch] = np.pad(e, ((0, 0), (0, depth - e.shape[1])), constant_values=np.nan)
        fig = plotting.line_plot(np.arange(1, depth + 1), series, "layer",
                                 f"share of ||P log A||^2 ({short.replace('_', '-')} term)",
                                 f"{title}: {LABELS[key]}", errors=errors or None)
        paths += plotting.save(fig, directory, f"{stem}_{short}")
    return paths
