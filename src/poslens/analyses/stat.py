"""`poslens stat NAME MODEL`: any registered statistic (`poslens.engine.statistics.REGISTRY`) over real text, to a
run directory with its intervals and a default figure.

The statistic runs alone on the analysis pipeline (one pass); its `result(level)` is saved as it is, and every
estimated tensor (one with `_lo`/`_hi`, or `_se` beside the stored `t_quantile`) gets a line of summary in
run.json and a figure: a line per row with error bars for vectors and small tables, heatmaps for maps.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from poslens.engine.config import SEQUENCES_HELP, ModelData
from poslens.engine.pipeline import Analysis, Job, Output, Pass, report_lines, run_analysis
from poslens.engine.statistics import REGISTRY, Spec, spec
from poslens.engine.stats import Statistic
from poslens.options import add_options, add_output_args, check_options, from_args, option_of

MAX_LINES = 8  # a square table with more rows than this (not per layer) is drawn as a map


@dataclass
class StatConfig(ModelData):
    """The model and text of `poslens stat` (shorter defaults than the paper's analyses: a quick first look)."""

    seq_len: int = option_of(ModelData, "seq_len", 128)
    num_sequences: int | None = option_of(ModelData, "num_sequences", 200, help=SEQUENCES_HELP)
    batch_size: int = option_of(ModelData, "batch_size", 10)


class StatAnalysis(Analysis):
    """One registered statistic, alone: one pass, its result, a summary and a figure per estimated tensor."""

    kind = "stat"

    def __init__(self, registered: Spec, options: Any) -> None:
        if dataclasses.is_dataclass(options):
            check_options(options)  # its declared bounds (a negative ridge, ...), before anything is loaded
        self.spec, self.options = registered, options

    def check(self, job: Job) -> None:
        statistic = self.spec.build(job.hm, self.options, 2)
        statistic.check_model(job.hm)  # its points, before the text is cut
        statistic.check_length(job.config.seq_len)

    def passes(self, job: Job) -> list[Pass]:
        return [Pass(self.spec.name, [self.spec.build(job.hm, self.options, job.groups)])]

    def finish(self, job: Job, passes: list[Pass]) -> Output:
        statistic = passes[0].statistics[0]
        tensors = statistic.result(level=job.config.level)
        estimates = {name: describe(tensors, name) for name in estimated(tensors)}
        return Output(tensors, {"statistic": self.spec.name, "level": job.config.level, "groups": job.groups,
                                "intervals": statistic.intervals.format(groups=job.groups),
                                "estimates": estimates},
                      {"statistic": {"name": self.spec.name, "options": asdict(self.options)}})

    def figures(self, job: Job, output: Output, directory: Path) -> list[Path]:
        return [p for name in estimated(output.tensors)
                for p in figure(output.tensors, name, directory, f"{job.label}: {self.spec.name}")]


def run_stat(name: str, cfg: StatConfig, options: Any = None, out: str | Path = "", force: bool = False,
             progress: bool = True) -> Path | None:
    """Run the registered statistic `name` (with `options`, an instance of its options dataclass; default its
    defaults) into the run directory `out` (default runs/stat-NAME); returns its path on rank 0."""
    registered = spec(name)
    options = registered.options() if options is None else options
    return run_analysis(StatAnalysis(registered, options), cfg, out or f"runs/stat-{name}", force=force,
                        progress=progress)


# ---------------------------------------------------------------- reading a result


def interval(tensors: dict[str, torch.Tensor], name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(lo, hi) of tensor `name`: its `_lo`/`_hi`, or value -/+ t_quantile * `_se`; None when it has neither."""
    if f"{name}_lo" in tensors and f"{name}_hi" in tensors:
        return tensors[f"{name}_lo"], tensors[f"{name}_hi"]
    if f"{name}_se" in tensors and "t_quantile" in tensors:
        half = float(tensors["t_quantile"].reshape(-1)[0]) * tensors[f"{name}_se"]
        return tensors[name] - half, tensors[name] + half
    return None


def estimated(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The tensors of a result that carry an interval."""
    return [k for k in tensors if interval(tensors, k) is not None]


def describe(tensors: dict[str, torch.Tensor], name: str) -> dict:
    """A tensor with its interval in a few numbers for run.json: shape, its mean over defined entries, and the
    widest and median half-widths of the intervals."""
    value = tensors[name].double()
    lo, hi = (t.double() for t in interval(tensors, name))
    half = ((hi - lo) / 2)[torch.isfinite(hi - lo)]
    return {"shape": list(value.shape), "mean": float(value[torch.isfinite(value)].mean()) if value.numel() else None,
            "widest_half_width": float(half.max()) if half.numel() else None,
            "median_half_width": float(half.median()) if half.numel() else None}


def summary_lines(meta: dict) -> list[str]:
    """What `poslens stat` prints: one line per estimated tensor, and the groups behind the intervals."""
    m = meta["metrics"]
    lines = []
    for name, e in m["estimates"].items():
        shape = " x ".join(map(str, e["shape"])) or "scalar"
        widest = "undefined" if e["widest_half_width"] is None else f"+/-{e['widest_half_width']:.4g}"
        median = "" if e["median_half_width"] is None else f", median +/-{e['median_half_width']:.4g}"
        mean = "nan" if e["mean"] is None else f"{e['mean']:.4g}"
        lines.append(f"{name} [{shape}]: mean {mean}; intervals widest {widest}{median}")
    how = m.get("intervals") or Statistic.intervals.format(groups=m["groups"])  # runs before it was recorded
    lines.append(f"intervals: {100 * m['level']:g}% {how}")
    return lines


def figure(tensors: dict[str, torch.Tensor], name: str, directory: Path, title: str) -> list[Path]:
    """The default figure of an estimated tensor: heatmaps for maps (a stack of square maps, one per leading index,
    or one square map whose rows are not layers), else lines with error bars (a vector, or a table: one line per
    row, e.g. per layer against position)."""
    from poslens import plotting

    value = np.asarray(tensors[name].double().cpu())
    lo, hi = (np.asarray(t.double().cpu()) for t in interval(tensors, name))
    rows = [f"layer {int(i) + 1}" for i in tensors["layers"]] if "layers" in tensors else None
    square_map = value.ndim == 3 and value.shape[1] == value.shape[2] or \
        value.ndim == 2 and value.shape[0] == value.shape[1] and value.shape[0] > MAX_LINES and not rows
    if value.ndim in (1, 2) and not square_map:
        table, low, high = (np.atleast_2d(x) for x in (value, lo, hi))
        labels = rows if rows and len(rows) == len(table) else [f"row {i}" for i in range(len(table))]
        series = {labels[i] if len(table) > 1 else name: table[i] for i in range(len(table))}
        errors = {k: np.stack([table[i] - low[i], high[i] - table[i]]) for i, k in enumerate(series)}
        fig = plotting.line_plot(np.arange(table.shape[1]), series, "index (position)", name, title, errors=errors)
        return plotting.save(fig, directory, name.replace("/", "_"))
    maps = list(value) if value.ndim == 3 and value.shape[1] == value.shape[2] else [value]
    titles = (rows if rows and len(rows) == len(maps) else [f"{name} {i}" for i in range(len(maps))]) \
        if len(maps) > 1 else [name]
    fig = plotting.map_grid(maps, titles, ncols=min(8, len(maps)), limits="quantile", suptitle=title)
    return plotting.save(fig, directory, name.replace("/", "_"))


# ---------------------------------------------------------------- the command line


def add_statistics(parser: argparse.ArgumentParser) -> None:
    """`poslens stat NAME ...`: one sub-command per registered statistic, each with the model-and-data options,
    the statistic's own and --out/--force/--quiet."""
    sub = parser.add_subparsers(dest="statistic", required=True, metavar="NAME", parser_class=type(parser))
    for name in REGISTRY:
        registered = spec(name)
        p = sub.add_parser(name, help=registered.help, description=f"{registered.help}, with confidence intervals "
                           "over groups of sequences; writes its tensors, run.json and a figure per estimated tensor")
        add_options(p, StatConfig)
        add_options(p, registered.options, group=f"{name} options")
        add_output_args(p, f"runs/stat-{name}")


def cmd_stat(args: argparse.Namespace) -> None:
    """Run the statistic named on the command line; print its summary."""
    registered = spec(args.statistic)
    path = run_stat(args.statistic, from_args(StatConfig, args), from_args(registered.options, args), args.out,
                    force=args.force, progress=not args.quiet)
    if path is not None:
        print("\n".join(report_lines(path, summary_lines)))
