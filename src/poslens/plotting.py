"""The one plotting module: heatmaps in the paper's look (query on y, key on x, upper triangle blank).

Every figure poslens writes goes through `heatmap`, `map_grid`, `line_plot` and `save`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FuncFormatter, MaxNLocator, NullLocator  # noqa: E402

from poslens.maps import as_numpy, quantile_limits  # noqa: E402

CMAP = "magma"  # close to the paper's "rocket" and available without seaborn
DIVERGING = "coolwarm"  # signed maps (a difference), with limits symmetric about 0; its centre is grey, not blank


def heatmap(ax, m, vmin: float | None = None, vmax: float | None = None, cmap: str = CMAP,
            title: str | None = None, colorbar: bool = True, annotate: bool = False, fontsize: float = 6,
            one_based: bool = False):
    """Draw one [n, n] map on `ax`: NaN cells blank, key index on x, query index on y (row 0 at the top).

    annotate: print each value (in `fontsize` points); one_based: label every tick 1..n (small maps); otherwise a
    few ticks, also counting positions from 1."""
    m = as_numpy(m)
    if vmin is None or vmax is None:
        lo, hi = quantile_limits(m, (0.0, 1.0))
        vmin = lo if vmin is None else vmin
        vmax = hi if vmax is None else vmax
    cm = plt.get_cmap(cmap).with_extremes(bad="white")
    im = ax.imshow(np.ma.masked_invalid(m), cmap=cm, vmin=vmin, vmax=vmax, interpolation="nearest", aspect="equal")
    ax.set_xlabel("key j")
    ax.set_ylabel("query i")
    if title:
        ax.set_title(title, fontsize=9)
    if annotate:
        for (i, j), v in np.ndenumerate(m):
            if np.isfinite(v):
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=fontsize,
                        color="white" if v < (vmin + vmax) / 2 else "black")
    n = m.shape[-1]
    if one_based:
        ax.set_xticks(range(n), [str(k + 1) for k in range(n)])
        ax.set_yticks(range(n), [str(k + 1) for k in range(n)])
    else:  # positions count from 1, as in the paper: ticks at 1 and at round numbers
        ticks = [1] + [int(t) for t in MaxNLocator(5, integer=True).tick_values(1, n) if 1 < t <= n]
        ax.set_xticks([t - 1 for t in ticks], [str(t) for t in ticks])
        ax.set_yticks([t - 1 for t in ticks], [str(t) for t in ticks])
    if colorbar:
        cb = ax.figure.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        cb.ax.tick_params(labelsize=7)
        cb.formatter = FuncFormatter(lambda v, _: f"{v:.3g}")  # short labels: none cut
        cb.update_ticks()
    return im


def map_grid(maps: Sequence, titles: Sequence[str], ncols: int | None = None,
             limits: str | tuple[float, float] | Sequence[tuple[float, float]] = "each",
             cmap: str | Sequence[str] = CMAP, suptitle: str | None = None, row_labels: Sequence[str] | None = None,
             panel_size: float = 2.6):
    """A grid of heatmaps. limits: 'each' (min-max per panel), 'quantile' (1%-99% per panel),
    'shared' (one min-max for all), a (vmin, vmax) pair, or one pair per panel; cmap: one for all, or one per
    panel."""
    n = len(maps)
    ncols = ncols or n
    nrows = int(np.ceil(n / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(panel_size * ncols + 0.6, panel_size * nrows + 0.4),
                             squeeze=False, constrained_layout=True)
    if limits == "shared":
        lo, hi = quantile_limits(np.stack([as_numpy(m) for m in maps]), (0.0, 1.0))
        lims = [(lo, hi)] * n
    elif isinstance(limits, str):
        q = (0.0, 1.0) if limits == "each" else (0.01, 0.99)
        lims = [quantile_limits(m, q) for m in maps]
    elif isinstance(limits[0], (int, float)):
        lims = [tuple(limits)] * n
    else:
        lims = list(limits)
    for k, ax in enumerate(axes.flat):
        if k >= n:
            ax.axis("off")
            continue
        heatmap(ax, maps[k], *lims[k], cmap=cmap if isinstance(cmap, str) else cmap[k], title=titles[k])
        if k % ncols:
            ax.set_ylabel("")
        if row_labels and k % ncols == 0:
            ax.set_ylabel(f"{row_labels[k // ncols]}\nquery i")
    if suptitle:
        fig.suptitle(suptitle, fontsize=11)
    return fig


def layer_maps(scores, directory, stem: str, label: str, titles: Sequence[str], limits="quantile",
               normalised: bool = True, causal: bool = True, ncols: int | None = None) -> list[Path]:
    """All layers' mean scores in one grid, then (normalised=True) their diagonal-normalised maps in another
    (1%-99% quantile limits): stem.{png,pdf} and stem_normalised.{png,pdf}."""
    from poslens.maps import diagonal_normalise

    scores = as_numpy(scores)
    paths = save(map_grid(list(scores), titles, ncols=ncols, limits=limits,
                          suptitle=f"{label}: mean pre-softmax scores"), directory, stem)
    if normalised:
        paths += save(map_grid(list(diagonal_normalise(scores, causal=causal)), titles, ncols=ncols,
                               limits="quantile", suptitle=f"{label}: diagonal-normalised"),
                      directory, stem + "_normalised")
    return paths


LINE_SIZE = (7.6, 4.8)  # inches: 760 x 480 px at DPI, readable in the report at full width


def _finish(ax, xlabel: str, ylabel: str, title: str | None) -> None:
    """Labels, title, grid and the legend: below the axes (outside them, so it never hides a line or an error bar),
    in two columns when there are more than two series with short enough labels."""
    ax.set_xlabel(xlabel, fontsize=11)
    ax.set_ylabel(ylabel, fontsize=11)
    ax.tick_params(labelsize=10)
    if title:
        ax.set_title(title, fontsize=12)
    handles, labels = ax.get_legend_handles_labels()
    if labels:  # two columns fit the figure's width for labels up to about 40 characters
        two = len(labels) > 2 and max(map(len, labels)) <= 40
        ax.figure.legend(handles, labels, fontsize=9, loc="outside lower center", ncols=2 if two else 1,
                         frameon=False)
    ax.grid(alpha=0.3)


def integer_ticks(xs) -> list[int]:
    """Ticks for integer x values counted from their first one (layers and positions from 1): the first value,
    then round numbers up to the last (never a tick before the first value, such as a layer 0)."""
    first, last = int(min(xs)), int(max(xs))
    return [first] + [int(t) for t in MaxNLocator(8, integer=True).tick_values(first, last) if first < t <= last]


LINE_STYLES = (("-", "o"), ("--", "none"), (":", "s"), ("-.", "^"), ((0, (5, 1, 1, 1, 1, 1)), "D"))


def colours(n: int) -> list:
    """n colours that tell n series apart: matplotlib's ten (C0-C9) up to 10, tab20 up to 20, else n samples of the
    turbo map (the ten cycle, and a figure with more series than colours showed two series in one)."""
    if n <= 10:
        return [f"C{i}" for i in range(n)]
    if n <= 20:
        return [matplotlib.colormaps["tab20"](i) for i in range(n)]
    return [matplotlib.colormaps["turbo"](i / (n - 1)) for i in range(n)]


def line_plot(xs, series: dict[str, Sequence[float]], xlabel: str, ylabel: str, title: str | None = None,
              logx: bool = False, logy: bool = False, errors: dict[str, Sequence[float]] | None = None,
              xticklabels: Sequence[str] | None = None, joined: bool = True, paired: bool = False):
    """Lines with optional error bars (symmetric [n] or [2, n] lower/upper), one per named series, each in its own
    colour (`colours`). paired: series whose names share the part after their last ', ' (a setting, a model) share
    a colour, and those that share the part before it (a quantity) a line style and marker: the first solid with
    dots, the second dashed, then dotted with squares, dash-dotted with triangles, ... Integer x
    values get integer ticks from the first value (`integer_ticks`: a layer axis from 1 shows no 0); on a log
    x-axis the ticks are the x values themselves (no overlapping labels); xticklabels names each x (categories,
    such as variants or position ranges, instead of numbers decoded in a caption); joined=False leaves a series'
    points unjoined (categories without an order, such as variants). logy: a log y-axis, or a symmetric log one
    where a value or bound is at or below 0 (`symlog_threshold`), every bar inside it."""
    fig, ax = plt.subplots(figsize=LINE_SIZE, layout="constrained")
    # several series with error bars: each a little apart (by a factor on a log x), so that bars at one x do not hide
    # each other
    dodge = xticklabels is not None or (errors is not None and len(series) > 1)
    step = dodge_step(xs, len(series), logx) if dodge else 0.0
    # paired: the setting (after the last ', ') gives the colour, the quantity (before it) the line style
    group = {name: name.rsplit(", ", 1)[-1] if paired else name for name in series}
    quantity = {name: name.rsplit(", ", 1)[0] if paired else "" for name in series}
    settings, quantities = list(dict.fromkeys(group.values())), list(dict.fromkeys(quantity.values()))
    colour = dict(zip(settings, colours(len(settings))))
    for k, (name, ys) in enumerate(series.items()):
        err = None if errors is None else errors.get(name)
        shift = step * (k - (len(series) - 1) / 2)
        at = ([x * 2 ** shift for x in xs] if logx else [x + shift for x in xs]) if dodge else xs
        line, marker = LINE_STYLES[quantities.index(quantity[name]) % len(LINE_STYLES)]
        style = {"marker": marker, "ms": 4, "linestyle": line if joined else "none", "color": colour[group[name]]}
        ax.errorbar(at, ys, yerr=err, capsize=3, label=name, **style)
    if xticklabels is not None:
        ax.set_xticks(list(xs), list(xticklabels))
    elif logx:
        ax.set_xscale("log")
        ax.set_xticks(list(xs), [f"{x:g}" for x in xs])
        ax.xaxis.set_minor_locator(NullLocator())
    elif len(xs) and all(float(x).is_integer() for x in xs):
        ax.set_xticks(integer_ticks(xs))
    threshold = symlog_threshold(series, errors) if logy else None
    if threshold is not None:
        ax.set_yscale("symlog", linthresh=threshold)
        ax.axhline(0, color="0.3", lw=0.8)
        _, lows, highs = _extent(series, errors)
        pad_limits(ax, np.nanmin(lows), np.nanmax(highs))  # every bar inside the axis, a 0 at the bottom included
        lo, hi = ax.get_ylim()  # ticks at 0 and at the decades outside the linear range: none crowds the 0
        top = max(abs(lo), abs(hi), threshold)
        ks = range(int(np.floor(np.log10(threshold))), int(np.floor(np.log10(top))) + 1)
        ax.set_yticks(sorted([0.0] + [s * 10.0**k for k in ks for s in (1, -1) if lo <= s * 10.0**k <= hi]))
        ax.yaxis.set_minor_locator(NullLocator())
    elif logy:
        ax.set_yscale("log")
    _finish(ax, xlabel, ylabel, title)
    return fig


DODGE = 0.15  # the shift between neighbouring series at one x, as a fraction of the smallest gap between x values


def dodge_step(xs, n: int, logx: bool = False) -> float:
    """The shift between neighbouring series of `n` drawn at the same x values: DODGE of the smallest gap between
    distinct x values (in log2 x, a factor 2**step, on a log x-axis; a gap of 1 for one x), narrowed where needed so
    that the n series at one x span at most half of that gap (never into the next x's)."""
    u = np.unique(np.asarray(xs, dtype=float))
    u = u[np.isfinite(u)]
    if logx:
        u = np.log2(u[u > 0])
    gap = float(np.diff(u).min()) if u.size > 1 else 1.0
    return gap * min(DODGE, 0.5 / max(n - 1, 1))


def pad_limits(ax, lo: float, hi: float, pad: float = 0.05) -> None:
    """y limits `pad` of the drawn span beyond lo and hi, measured on the axis' own scale (a symmetric log one, say),
    so that a point or bar end at lo or hi (a 0 at the bottom) is drawn whole, marker and cap, inside the axes."""
    t = ax.yaxis.get_transform()
    a, b = t.transform(np.array([lo, hi], dtype=float))
    span = (b - a) or 1.0
    ax.set_ylim(*t.inverted().transform(np.array([a - pad * span, b + pad * span])))


def _extent(series: dict[str, Sequence[float]], errors: dict | None) -> tuple[np.ndarray, ...]:
    """Every finite value of the series, and the lower and upper ends of their error bars (the values without)."""
    values, lows, highs = [], [], []
    for name, ys in series.items():
        y = np.asarray(ys, dtype=float)
        err = None if errors is None else errors.get(name)
        e = np.zeros((2, len(y))) if err is None else np.broadcast_to(np.asarray(err, dtype=float), (2, len(y)))
        values.append(y)
        lows.append(y - e[0])
        highs.append(y + e[1])
    return tuple(x[np.isfinite(x)] for x in map(np.concatenate, (values, lows, highs)))


def symlog_threshold(series: dict[str, Sequence[float]], errors: dict | None = None) -> float | None:
    """None when every value and lower bound is above 0 (a log axis draws them all); else the linear range of a
    symmetric log axis: the power of ten at or below the smallest |value| above 0 (1 when there is none)."""
    v, lo, _ = _extent(series, errors)
    if (v > 0).all() and (lo > 0).all():
        return None
    pos = np.abs(v[v != 0])
    return float(10 ** np.floor(np.log10(pos.min()))) if pos.size else 1.0


def row_profiles(maps: Sequence, se: Sequence | None, rows: Sequence[int], titles: Sequence[str],
                 suptitle: str | None = None, ylabel: str = "score", band: float = 2.0, ncols: int = 3,
                 first_key: int = 1):
    """Score against key for a few query rows of each map (one panel per map): m[i, j] for keys first_key <= j < i
    (the diagonal, a token with itself, is left out: it would dwarf the rest; first_key = 2 leaves out an
    attention-sink column), keys and queries numbered from 1, with a band of +/- `band` standard errors when `se`
    is given. This is what "the scores increase with j for fixed i" looks like, noise included."""
    n = len(maps)
    ncols = min(ncols, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.4 * ncols + 0.8, 3.6 * nrows + 0.5), squeeze=False,
                             constrained_layout=True)
    for k, ax in enumerate(axes.flat):
        if k >= n:
            ax.axis("off")
            continue
        m = as_numpy(maps[k])
        for r, i in enumerate(rows):
            js = np.arange(first_key, i + 1)
            ys = m[i, first_key - 1:i]
            ax.plot(js, ys, lw=1.2, color=f"C{r}", label=f"query i = {i + 1}")
            if se is not None:
                e = band * as_numpy(se[k])[i, first_key - 1:i]
                ax.fill_between(js, ys - e, ys + e, color=f"C{r}", alpha=0.25, lw=0)
        ax.set_title(titles[k], fontsize=11)
        ax.set_xlabel("key j", fontsize=10)
        if k % ncols == 0:
            ax.set_ylabel(ylabel, fontsize=10)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=9)
    handles, labels = axes.flat[0].get_legend_handles_labels()  # below the panels: it never hides a band
    fig.legend(handles, labels, fontsize=9, loc="outside lower center", ncols=min(len(labels), 4))
    if suptitle:
        fig.suptitle(suptitle + (f" (bands: +/- {band:g} SE)" if se is not None else ""), fontsize=12)
    return fig


def curves(series: dict[str, Sequence[tuple[float, float]]], xlabel: str, ylabel: str, title: str | None = None,
           markers: Sequence[str] = ()):
    """(x, y) curves by name; names in `markers` drawn as dots joined by lines, the others as thin lines. Names
    that share their first word share a colour (e.g. "NoPE train" and "NoPE held-out")."""
    fig, ax = plt.subplots(figsize=LINE_SIZE, layout="constrained")
    colours: dict[str, str] = {}
    for name, points in series.items():
        xs, ys = zip(*points)
        colour = colours.setdefault(name.split()[0], f"C{len(colours)}")
        if name in markers:
            ax.plot(xs, ys, marker="o", ms=4, color=colour, label=name)
        else:
            ax.plot(xs, ys, lw=0.9, alpha=0.5, color=colour, label=name)
    _finish(ax, xlabel, ylabel, title)
    return fig


def offdiag_limits(m, q: tuple[float, float] = (0.0, 1.0)) -> tuple[float, float]:
    """Colour limits from the entries off the diagonal (for maps whose diagonal is a constant, such as 1 for
    l2-normalised inputs, and would otherwise stretch the scale over the whole pattern)."""
    m = as_numpy(m).copy()
    idx = np.arange(m.shape[-1])
    m[..., idx, idx] = np.nan
    return quantile_limits(m, q)


DPI = 100  # raster figures for the HTML report; PDFs are vector


def save(fig, directory: str | os.PathLike, stem: str, formats: Sequence[str] = ("png", "pdf"),
         dpi: int = DPI) -> list[Path]:
    """Save `fig` as directory/stem.{png,pdf} (or any of png, jpg, pdf) and close it. JPEG (quality 85) keeps
    large heatmap grids small in the HTML report. Each image is drawn in memory and written complete
    (`poslens.io.writing`: a full disk or a file-size limit is one line naming the file).

    The figure is drawn once at `dpi`, solving its layout; the raster formats are encoded from that drawing (the
    same pixels `savefig` draws again) and the PDF is drawn with the layout fixed (savefig with a layout engine set
    solves it twice more, a third of a many-panel grid's time)."""
    import io

    from PIL import Image

    from poslens.io.writing import write_bytes

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    fig.set_dpi(dpi)
    fig.canvas.draw()  # the layout engine (constrained) runs here, once
    fig.set_layout_engine(None)  # the layout stays as solved (None, not "none": a placeholder engine still
    # makes savefig draw the figure once more before printing it)
    pixels = None
    paths = []
    for ext in formats:
        p = directory / f"{stem}.{ext}"
        buffer = io.BytesIO()
        if ext in ("png", "jpg"):
            if pixels is None:
                pixels = Image.fromarray(np.asarray(fig.canvas.buffer_rgba()))
            if ext == "png":
                pixels.save(buffer, format="png", dpi=(dpi, dpi))
            else:  # the figure's background is opaque: its RGB channels are the picture
                pixels.convert("RGB").save(buffer, format="jpeg", quality=85, dpi=(dpi, dpi))
        else:
            fig.savefig(buffer, format=ext, dpi=None if ext == "pdf" else dpi)
        write_bytes(p, buffer.getvalue())
        paths.append(p)
    plt.close(fig)
    return paths
