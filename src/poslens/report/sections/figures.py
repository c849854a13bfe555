"""Figures of report sections: a static image (drawn by poslens.plotting) and, for heatmaps, the same maps as
data for the HTML report's zoomable, hoverable view."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from poslens import plotting
from poslens.maps import as_numpy, quantile_limits
from poslens.report.section import Figure, Panel

NOISE_STD = 2  # entries below the diagonal spread by under this many standard errors: noise, not a pattern
VISIBLE = 20  # ... and the noise is what the colours show when the colour range is under this many standard errors


def noise_only(panel: Panel) -> bool:
    """Whether what a panel shows is sampling noise: the entries below the diagonal spread (std) by fewer than
    NOISE_STD median standard errors, and the colour range is narrow enough (VISIBLE standard errors) for that noise
    to be what a reader sees."""
    if panel.se is None:
        return False
    low = np.tril_indices(panel.se.shape[-1], -1)
    se, v = panel.se[low], panel.values[low]
    ok = np.isfinite(se) & np.isfinite(v)
    if not ok.any():
        return False
    noise = float(np.median(se[ok]))
    lo, hi = limits_of(panel)
    return float(np.std(v[ok])) < NOISE_STD * noise and (hi - lo) < VISIBLE * noise


def share_limits(panels: Sequence[Panel], q: tuple[float, float] = (0.01, 0.99)) -> list[Panel]:
    """`panels` with one colour scale, for a figure whose panels are compared with each other: the `q` quantiles of
    every panel's off-diagonal entries together (`plotting.offdiag_limits`)."""
    shared = plotting.offdiag_limits(np.stack([as_numpy(p.values) for p in panels]), q)
    return [Panel(p.title, p.values, p.se, shared, p.cmap) for p in panels]


def limits_of(panel: Panel) -> tuple[float, float]:
    return panel.limits if panel.limits is not None else quantile_limits(panel.values, (0.0, 1.0))


def heatmaps(ctx, stem: str, panels: Sequence[Panel], caption: str, ncols: int = 4, suptitle: str | None = None,
             row_labels: Sequence[str] | None = None, big: bool = False, interactive: bool = True,
             warning: str = "", panel_size: float = 2.6) -> Figure:
    """A grid of heatmaps saved as figures/stem (JPEG when big) with a PDF, and returned as a report Figure whose
    panels the HTML draws interactively, each in its own colour map (interactive=False: the static image only, for
    very large grids)."""
    if not ctx.draw:
        return Figure(ctx.figures / f"{stem}.png", caption)
    panels = [Panel(p.title, as_numpy(p.values), None if p.se is None else as_numpy(p.se), limits_of(p), p.cmap)
              for p in panels]
    noisy = [p.title for p in panels if noise_only(p)]
    if noisy:
        warning = (warning + " " if warning else "") + (
            f"What {'this panel shows' if len(noisy) == 1 else 'these panels show'} entry by entry is mostly "
            f"sampling noise (the entries spread by under {NOISE_STD} of their standard errors): "
            + "; ".join(noisy) + ". A statistic over many entries (a row slope, a ratio) can still be resolved: "
            "read its interval in the rows, not the picture.")
    fig = plotting.map_grid([p.values for p in panels], [p.title for p in panels], ncols=ncols,
                            limits=[p.limits for p in panels], suptitle=suptitle, row_labels=row_labels,
                            panel_size=panel_size, cmap=[p.cmap for p in panels])
    path = ctx.save(fig, stem, big=big)
    return Figure(path, caption, panels if interactive else [], ncols=ncols, wide=big, warning=warning,
                  title=suptitle or "")


def profiles(ctx, stem: str, maps: Sequence, se: Sequence | None, titles: Sequence[str], caption: str,
             rows: Sequence[int] | None = None, suptitle: str | None = None, ylabel: str = "score",
             first_key: int = 1) -> Figure:
    """Score against key for a few query rows of each map, with +/- 2 SE bands (the 'increasing in j' claims),
    from key `first_key` (counted from 1)."""
    if not ctx.draw:
        return Figure(ctx.figures / f"{stem}.png", caption)
    n = as_numpy(maps[0]).shape[-1]
    rows = list(rows) if rows is not None else sorted({max(2, n // 4), n // 2, n - 1})
    fig = plotting.row_profiles(maps, se, rows, titles, suptitle=suptitle, ylabel=ylabel, first_key=first_key)
    noisy = [] if se is None else [t for m, e, t in zip(maps, se, titles) if profile_noise(m, e, rows, first_key)]
    warning = "" if not noisy else (
        f"What {'this panel shows' if len(noisy) == 1 else 'these panels show'} is mostly sampling noise (each drawn "
        f"row's scores spread over the keys by under {NOISE_STD} of their standard errors): " + "; ".join(noisy)
        + ". Read the rows' slopes and their intervals in the table, not the picture.")
    return Figure(ctx.save(fig, stem), caption, title=suptitle or "", warning=warning)


def profile_noise(m, se, rows: Sequence[int], first_key: int = 1) -> bool:
    """Whether the drawn rows of a map are mostly sampling noise: over the keys first_key .. i - 1 (from 1) of each
    drawn row i (0-based index), the scores' standard deviation is below NOISE_STD median standard errors."""
    m, se = as_numpy(m), as_numpy(se)
    vals = np.concatenate([m[i, first_key - 1:i] for i in rows if i > first_key])
    errs = np.concatenate([se[i, first_key - 1:i] for i in rows if i > first_key])
    ok = np.isfinite(vals) & np.isfinite(errs)
    return bool(ok.sum() >= 2 and np.std(vals[ok]) < NOISE_STD * np.median(errs[ok]))


def lines(ctx, stem: str, xs, series: dict, caption: str, xlabel: str, ylabel: str, title: str,
          errors: dict | None = None, logx: bool = False, logy: bool = False, zero: bool = False,
          xticklabels: Sequence[str] | None = None, joined: bool = True, vline: float | None = None,
          hline: float | None = None, paired: bool = False) -> Figure:
    """A line plot (error bars optional; xticklabels: a name for each x; joined=False: points of a series not
    joined, for categories without an order; vline / hline: a dashed line at that x (a training length) or y (a
    chance level))
    saved as figures/stem.png and .pdf."""
    t = plotting.symlog_threshold(series, errors) if logy else None  # the axis line_plot draws: say so
    if t is not None:
        caption += (f" Vertical axis: symmetric log scale, linear within +/-{t:g}, so that estimates and bounds at "
                    "or below 0 are drawn.")
    if not ctx.draw:
        return Figure(ctx.figures / f"{stem}.png", caption)
    fig = plotting.line_plot(list(xs), series, xlabel, ylabel, title, logx=logx, logy=logy, errors=errors,
                             xticklabels=xticklabels, joined=joined, paired=paired)
    if zero:
        fig.axes[0].axhline(0, color="0.3", lw=0.8)
    if vline is not None:
        fig.axes[0].axvline(vline, color="0.3", lw=0.8, ls="--")
    if hline is not None:
        fig.axes[0].axhline(hline, color="0.3", lw=0.8, ls="--")
    return Figure(ctx.save(fig, stem), caption, title=title)


def interval_errors(value, lo, hi) -> np.ndarray:
    """[2, n] error-bar lengths from an interval (NaN bounds draw no bar)."""
    v, lo, hi = (np.asarray(x, dtype=float) for x in (value, lo, hi))
    return np.nan_to_num(np.stack([v - lo, hi - v]), nan=0.0)
