"""Command-line wiring of `poslens intermediates MODEL --layer L`: ``add_command(sub)`` adds it.

Options come from `IntermediatesConfig` (poslens.options); `--out/--force/--quiet` are command-level.
"""

from __future__ import annotations

import argparse

from poslens.options import add_options, from_args

HELP = "Figure 3's nine Gram matrices of layers L and L+1, and Figure 8 (every layer's scores) for any model"
DESCRIPTION = ("Averaged over sequences (and heads): (a) Y Y^T after the input norm, (b) Q K^T * scaling, "
               "(c) (AV)(AV)^T, (d) after W_O, (e) after adding the residual, (f) after the post-attention norm, "
               "(g) after the FFN and residual, (h) the next layer's normalised input, (i) its Q K^T * scaling; "
               "each with a jackknife interval over groups of sequences. The block output is recomputed in float64 "
               "and checked against the model's hidden state. Figure 8: every layer's diagonal-normalised "
               "Q K^T * scaling. Paper defaults: 1,000 sequences of the first 50 tokens. Layers are indexed from 0 "
               "here and numbered from 1 in the figures.")


def add_command(sub: argparse._SubParsersAction) -> None:
    """Add the `intermediates` subcommand to `sub` (an argparse subparsers object)."""
    from poslens.analyses.intermediates import IntermediatesConfig

    p = sub.add_parser("intermediates", help=HELP, description=DESCRIPTION)
    add_options(p, IntermediatesConfig)
    p.add_argument("--out", default="runs/intermediates", help="run directory to write (default runs/intermediates)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_intermediates)


def summary_lines(meta: dict) -> list[str]:
    """One line per panel (row slope and off-diagonal/diagonal ratio with intervals), the amplification over the
    parameter-free stack, then the block check."""
    m = meta["metrics"]
    lines = []
    for letter, p in m["panels"].items():
        s, r = p["row_slope"], p["offdiag_ratio"]
        lines.append(f"({letter}) {p['what']:<32} row slope {s['value']:+.4g} [{s['lo']:+.4g}, {s['hi']:+.4g}]  "
                     f"off-diagonal/diagonal {r['value']:.3g} [{r['lo']:.3g}, {r['hi']:.3g}]")
    amp = m.get("amplification") or {}
    if "ratio" in amp:
        r, a = amp["ratio"], amp["alpha"]
        def num(x) -> str:  # run.json keeps NaN as null (an interval undefined in some replicate)
            return "nan" if x is None else f"{x:.3g}"

        lines.append(f"amplification (Section 4.2): panel (i)'s pattern is {num(r['value'])}x [{num(r['lo'])}, "
                     f"{num(r['hi'])}] the parameter-free stack's at alpha {num(a['value'])} from panel (a)")
    elif "skipped" in amp:
        lines.append(f"amplification: not measured ({amp['skipped']})")
    c = m.get("block_output_check")
    if c:
        lines.append(f"block output check (layer index {c['layer']}): max deviation {c['max_abs']:.3g}, "
                     f"{c['max_rel']:.3g} of the largest entry (tolerance {c['tolerance']:.3g}, {c['dtype']})")
    lines.append(f"intervals: {100 * m['level']:g}% jackknife over {m['groups']} groups of sequences")
    return lines


def cmd_intermediates(args: argparse.Namespace) -> None:
    from poslens.analyses.intermediates import IntermediatesConfig, run_intermediates
    from poslens.io.results import load

    cfg = from_args(IntermediatesConfig, args)
    path = run_intermediates(cfg, args.out, force=args.force, progress=not args.quiet)
    for line in summary_lines(load(path, tensors=False).meta):
        print(line)
    print(f"wrote {path}")
