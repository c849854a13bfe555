"""Figures of a `poslens length` run, through poslens.plotting: the loss against position with each intervention,
the attention entropy gap and the share on key 1 (the first token) against position (first and last layer), and the
averaged score maps at the longest length. Positions, keys and layers are numbered from 1 (the run's tensors index
them from 0: entry t is position t + 1)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from poslens import plotting
from poslens.analyses.length.loss import bin_spans


def _err(t: dict, name: str) -> np.ndarray:
    v, lo, hi = (np.asarray(t[f"{name}{s}"], dtype=float) for s in ("", "_lo", "_hi"))
    return np.nan_to_num(np.stack([v - lo, hi - v]), nan=0.0)


def bin_centres(train_len: int, n: int) -> np.ndarray:
    """Centres of the loss curve's bins (`loss.bin_spans`), as positions from 1: the bins are the 0-based target
    indices [1, L/4), [L/4, L/2), ... up to n, i.e. positions 2 to L/4, L/4 + 1 to L/2, ..."""
    return np.array([(a + b - 1) / 2 + 1 for a, b in bin_spans(train_len, n)])


def length_figures(metrics: dict, tensors: dict, directory: Path, label: str) -> list[Path]:
    """loss_by_position, attention_by_position and maps_at_T for the first model of the run (with seeds, `m0/`)."""
    L, T = metrics["train_len"], metrics["eval_lens"][-1]
    tag = "m0/" if "seeds" in metrics else ""
    t = {k[len(tag):]: v for k, v in tensors.items() if k.startswith(tag)}
    paths: list[Path] = []
    xs = bin_centres(L, T)
    series, errors = {}, {}
    for name in sorted(k for k in t if k.startswith("loss_binned") and not k.endswith(("_lo", "_hi", "_se"))):
        spec = name.split("/", 1)[1] if "/" in name else "none"
        series[spec] = np.asarray(t[name], dtype=float)
        errors[spec] = _err(t, name)
    fig = plotting.line_plot(xs, series, "target position (bins of L/4)", "next-token loss (nats)",
                             f"{label}: loss against position, L = {L} (95% jackknife)", errors=errors)
    fig.axes[0].axvline(L, color="0.3", lw=0.8, ls="--")
    paths += plotting.save(fig, directory, "loss_by_position")
    layers = np.asarray(t["profile/none/layers"]).tolist()
    for quantity, ylabel, what in (("gap", "log(keys seen) - attention entropy (nats)", "entropy gap"),
                                   ("key0", "attention on key 1", "share on key 1")):
        series, errors, idx = {}, {}, None
        shown = [s for s in ("none", "logn", "logn-all") if f"profile/{s}/{quantity}" in t]  # the denominator's term
        for spec in shown:
            name = f"profile/{spec}/{quantity}"
            if name not in t:
                continue
            v, e = np.asarray(t[name], dtype=float), _err(t, name)
            if idx is None:  # the queries read (every k-th), about 64 of them per line
                read = np.nonzero(np.isfinite(v[0]))[0]
                idx = read[:: max(1, len(read) // 64)]
            if v.shape[-1] <= idx[-1]:
                continue
            for row in sorted({0, len(layers) - 1}):
                key = f"{spec}, layer {layers[row] + 1}"
                series[key], errors[key] = v[row][idx], e[:, row][:, idx]
        if not series:
            continue
        fig = plotting.line_plot(idx + 1, series, "query position", ylabel, f"{label}: {what} by query, L = {L} "
                                 "(95% jackknife)", errors=errors)
        fig.axes[0].axvline(L, color="0.3", lw=0.8, ls="--")
        paths += plotting.save(fig, directory, f"attention_{quantity}_by_position")
    if "maps/scores" in t:
        maps = np.asarray(t["maps/scores"], dtype=float)
        titles = [f"layer {int(l) + 1}" for l in np.asarray(t["maps/layers"]).tolist()]
        fig = plotting.map_grid(list(maps), titles, ncols=min(4, len(titles)), limits="quantile",
                                suptitle=f"{label}: mean scores at {T} tokens (trained at {L})")
        paths += plotting.save(fig, directory, "maps_at_longest", formats=("jpg", "pdf"))
    return paths
