"""Benchmark: `poslens.plotting.save` against saving each format with matplotlib's own savefig (run by hand).

`save` draws a figure once (the constrained layout solved in that drawing), encodes the raster formats from it and
draws the PDF with the layout fixed. The baseline is what `save` did before (2026-11-29): `fig.savefig` per format,
the layout engine replaced by the "none" placeholder after the first, so the PDF's savefig drew once more before
printing. Both write the same pixels and the same PDF (checked first: the decoded PNG and the PDF with its creation
date left out). Figures: a map grid of `--panels` 16 x 16 heatmaps (the real-model section's 30 layers), a 4-panel
grid and a line plot with error bars; the arms alternate, CPU seconds of this process per save. A third arm, `save`
of the PNG alone (what `reproduce --no-pdf` writes), is timed against `save` of both.

    .venv/bin/python benchmarks/figures.py --repeats 7 --out benchmarks/results/cpu-figures/figures.json
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train import ratio_interval  # noqa: E402 (benchmarks/train.py)

from poslens import plotting  # noqa: E402
from poslens.io.writing import write_bytes  # noqa: E402


def savefig_each(fig, directory: Path, stem: str, formats=("png", "pdf"), dpi: int = plotting.DPI) -> list[Path]:
    """The baseline, `save` as it was: matplotlib's savefig once per format into memory, then written complete (the
    layout solved by the first, then the "none" placeholder); the PDF without its creation date."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in formats:
        p = directory / f"{stem}.{ext}"
        extra = {"pil_kwargs": {"quality": 85}} if ext == "jpg" else {}
        buffer = io.BytesIO()
        fig.savefig(buffer, format=ext, dpi=dpi if ext != "pdf" else None, metadata=_no_date(ext), **extra)
        write_bytes(p, buffer.getvalue())
        fig.set_layout_engine("none")
        paths.append(p)
    plt.close(fig)
    return paths


def _no_date(ext: str) -> dict | None:
    return {"CreationDate": None} if ext == "pdf" else None


def figures(panels: int) -> dict:
    """Makers of the figures timed, by name."""
    rng = np.random.default_rng(0)
    big = [np.tril(rng.random((16, 16))) for _ in range(panels)]
    small = big[:4]
    return {f"grid of {panels}": lambda: plotting.map_grid(big, [f"layer {i + 1}" for i in range(panels)], ncols=6),
            "grid of 4": lambda: plotting.map_grid(small, [f"layer {i + 1}" for i in range(4)], ncols=4),
            "line plot": lambda: plotting.line_plot([1, 2, 3, 4], {"a": [1, 2, 3, 2], "b": [2, 3, 1, 1]}, "x", "y",
                                                    "t", errors={"a": [0.1] * 4, "b": [0.2] * 4})}


def same_output(make, directory: Path) -> bool:
    """Whether both arms write the same PNG pixels and the same PDF (creation date left out)."""
    a = savefig_each(make(), directory / "a", "f")
    fig = make()
    real = fig.savefig

    def dated(buffer, format, **kw):  # the PDF without its creation date, as the baseline writes it
        return real(buffer, format=format, metadata=_no_date(format), **kw)

    fig.savefig = dated
    b = plotting.save(fig, directory / "b", "f")
    pixels = [np.asarray(Image.open(io.BytesIO(p.read_bytes()))) for p in (a[0], b[0])]
    return pixels[0].shape == pixels[1].shape and bool((pixels[0] == pixels[1]).all()) \
        and a[1].read_bytes() == b[1].read_bytes()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--panels", type=int, default=30)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    out = {"config": vars(args), "figures": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in figures(args.panels).items():
            check = Path(tmp) / name.replace(" ", "-")
            check.mkdir()
            identical = same_output(make, check)
            times = {"savefig each format": [], "save": [], "save, no PDF": []}
            arms = [("savefig each format", savefig_each), ("save", plotting.save),
                    ("save, no PDF", lambda f, d, stem: plotting.save(f, d, stem, formats=("png",)))]
            for r in range(args.repeats + 1):
                for arm, fn in arms[r % 3:] + arms[:r % 3]:  # the order rotating
                    fig = make()
                    start = time.process_time()
                    fn(fig, Path(tmp), "t")
                    if r:  # the first round warms up
                        times[arm].append(time.process_time() - start)
            ratio = ratio_interval([a / b for a, b in zip(times["save"], times["savefig each format"])])
            no_pdf = ratio_interval([a / b for a, b in zip(times["save, no PDF"], times["save"])])
            out["figures"][name] = {"cpu_seconds": {k: statistics.median(v) for k, v in times.items()},
                                    "save_over_savefig": list(ratio), "no_pdf_over_save": list(no_pdf),
                                    "same_output": identical, "all": times}
            print(f"{name}: savefig per format {statistics.median(times['savefig each format']):.2f} s, save "
                  f"{statistics.median(times['save']):.2f} s: {ratio[0]:.3f} [{ratio[1]:.3f}, {ratio[2]:.3f}] "
                  f"(same pixels and PDF: {identical}); the PNG alone (reproduce --no-pdf) "
                  f"{statistics.median(times['save, no PDF']):.2f} s: {no_pdf[0]:.3f} [{no_pdf[1]:.3f}, "
                  f"{no_pdf[2]:.3f}] of save", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
